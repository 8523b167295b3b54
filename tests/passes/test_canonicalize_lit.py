"""canonicalize, lit-style: export's checks and no-op casts go, the cache writes stay."""
from lit_helpers import FileCheck


def test_drops_checks_and_noop_casts_keeps_cache_writes(lit):
    r = lit.run("canonicalize", prior=[])
    FileCheck().check("aten._assert_tensor_metadata(").check("aten.to.dtype(").run(r.before)
    (FileCheck().check_not("aten._assert_tensor_metadata(").check_not("aten.to.dtype(%caches")
     .run(r.after))
    for op in ("k31c.kda_decode(", "k31c.mla_cache_write(", "k31c.index_cache_write(",
               "k31c.lightning_indexer(", "k31c.topk_select(", "k31c.sparse_mla("):
        FileCheck().check_count(op, 1, exactly=True).run(r.after)
    # every `.float()` of a float32 value is gone; casts that change a dtype stay
    assert r.after.count("aten.to.dtype(") < r.before.count("aten.to.dtype(")
    stats = r.record.result.stats
    assert stats["checks"] > 0 and stats["noops"] > 0 and stats["reordered"] == 0
    assert r.before.count("\n") - r.after.count("\n") == stats["checks"] + stats["noops"] + stats["dead"]


def test_is_idempotent(lit):
    first = lit.run("canonicalize", prior=[])
    again = lit.run("canonicalize", prior=["canonicalize"])
    assert again.after == first.after and not again.record.result.changed
