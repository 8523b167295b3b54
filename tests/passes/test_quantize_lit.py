"""quantize, lit-style: cache formats recorded on the ops; MXFP8 q/k as a rewrite."""
from lit_helpers import FileCheck

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write", "fuse_lightning_indexer"]


def test_records_cache_formats(lit):
    r = lit.run("quantize", prior=PRIOR)
    (FileCheck()
     .check("k31c.index_key_norm_write(").check_same("index_cache=f32")
     .check("k31c.mla_cache_write(").check_same("latent_cache=f32")
     .check("k31c.lightning_indexer_topk(").check_same("index_cache=f32")
     .run(r.after))
    FileCheck().check_not("mxfp8").run(r.after)
    assert r.record.result.stats == {"index_cache": ["f32"], "latent_cache": ["f32"], "mxfp8_nodes": 0,
                                     "split_writes": 0}


def test_mxfp8_splits_the_fused_write_and_quantizes_q_and_k(lit):
    r = lit.run("quantize", prior=PRIOR, options={"mxfp8_indexer": True})
    FileCheck().check_count("mxfp8_quant_dequant(", 2, exactly=True).run(r.after)
    (FileCheck()
     .check("aten.layer_norm(").check_same("stream=1")
     .check("= mxfp8_quant_dequant(").check_same("stream=1")
     .check("k31c.index_cache_write(%caches.mla.0.index, %layers.1.self_attn.indexer/mxfp8_quant_dequant,")
     .check("%layers.1.self_attn.indexer/mxfp8_quant_dequant#1 = mxfp8_quant_dequant("
            "%layers.1.self_attn.indexer/unflatten)").check_same("stream=0")
     .check("k31c.lightning_indexer_topk(%layers.1.self_attn.indexer/mxfp8_quant_dequant#1,")
     .run(r.after))
    FileCheck().check_not("k31c.index_key_norm_write(").run(r.after)
    assert r.record.result.stats["mxfp8_nodes"] == 2 and r.record.result.stats["split_writes"] == 1
