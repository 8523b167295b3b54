"""fuse_lightning_indexer, lit-style: scoring → top-k becomes lightning_indexer_topk."""
from lit_helpers import FileCheck

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write"]


def test_fuses_scoring_and_topk(lit):
    r = lit.run("fuse_lightning_indexer", prior=PRIOR)
    FileCheck().check("k31c.lightning_indexer(").check_next("k31c.topk_select(").run(r.before)
    FileCheck().check_not("k31c.lightning_indexer(").check_not("k31c.topk_select(").run(r.after)
    (FileCheck()
     .check("k31c.region_exit(0)")
     .check_next("%layers.1.self_attn.indexer/lightning_indexer_topk = k31c.lightning_indexer_topk("
                 "%layers.1.self_attn.indexer/unflatten, %layers.1.self_attn.indexer/mul, %caches.mla.0.index, "
                 "%meta.block_table, %meta.row_req, %meta.row_len, 16) : i32[B, 16]")
     .check_same("fused=lightning_indexer+topk_select")
     .check("k31c.sparse_mla(").check_same("%layers.1.self_attn.indexer/lightning_indexer_topk")
     .run(r.after))
    assert r.record.result.stats == {"fused": 1, "left": 0}
