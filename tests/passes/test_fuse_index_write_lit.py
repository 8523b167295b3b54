"""fuse_index_write, lit-style: LayerNorm → index_cache_write becomes index_key_norm_write."""
from lit_helpers import FileCheck

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog"]


def test_fuses_the_key_chain_on_its_stream(lit):
    r = lit.run("fuse_index_write", prior=PRIOR)
    FileCheck().check("aten.layer_norm(").check("k31c.index_cache_write(").run(r.before)
    (FileCheck().check_not("aten.layer_norm(").check_not("k31c.index_cache_write(").run(r.after))
    (FileCheck()
     .check("%layers.1.self_attn.indexer/index_key_norm_write = k31c.index_key_norm_write("
            "%caches.mla.0.index, %layers.1.self_attn.indexer.wk/linear, "
            "@layers.1.self_attn.indexer.k_norm.weight, @layers.1.self_attn.indexer.k_norm.bias, "
            "%meta.slot_mapping, 1e-06)")
     .check_same("stream=1").check_same("fused=layer_norm+index_cache_write")
     .run(r.after))
    assert r.record.result.stats == {"fused": 1, "left": 0}


def test_never_fuses_across_streams(lit):
    gm, _ = lit.graph(PRIOR)
    ln = next(n for n in gm.graph.nodes if n.target is __import__("torch").ops.aten.layer_norm.default)
    ln.meta["k31c"]["stream"] = 0                            # the norm back on the main stream
    r = lit.run("fuse_index_write", prior=PRIOR, gm=gm)
    assert r.after == r.before and r.record.result.stats == {"fused": 0, "left": 1}
    FileCheck().check("%layers.1.self_attn.indexer/index_cache_write: not fused: the LayerNorm (stream 0) "
                      "and the write (stream 1) differ").run(r.record.result.notes[1])
