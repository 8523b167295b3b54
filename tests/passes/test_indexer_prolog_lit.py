"""indexer_prolog, lit-style: the indexer's key and head-weight branches in one region on
streams 1 and 2, forked after the layer input and joined before scoring."""
from lit_helpers import FileCheck, lines_with

PRIOR = ["canonicalize", "annotate_layers"]


def test_region_on_three_streams(lit):
    r = lit.run("indexer_prolog", prior=PRIOR)
    FileCheck().check_not("k31c.region_enter").check_not("stream=1").run(r.before)
    (FileCheck()
     .check("%layers.1.input_layernorm/getitem#1")
     .check("k31c.region_enter(0, 'indexer_prolog')").check_same("stream=0")
     .check("k31c.event_record(0, 0)").check_same("stream=0")
     .check("k31c.event_wait(0, 1)").check_same("stream=1")
     .check("%layers.1.self_attn.indexer.wk/linear").check_same("stream=1").check_same("branch=key")
     .check("aten.layer_norm(").check_same("stream=1")
     .check("k31c.index_cache_write(").check_same("stream=1").check_same("branch=key")
     .check("k31c.event_record(1, 1)").check_same("stream=1")
     .check("k31c.event_wait(0, 2)").check_same("stream=2")
     .check("%layers.1.self_attn.indexer.weights_proj/linear").check_same("stream=2")
     .check("k31c.event_record(2, 2)").check_same("stream=2")
     .check("%layers.1.self_attn.q_a_proj/linear").check_same("stream=0")      # overlaps the side streams
     .check("%layers.1.self_attn.indexer.wq_b/linear").check_same("branch=query")
     .check("k31c.event_wait(1, 0)").check_same("stream=0")
     .check("k31c.event_wait(2, 0)").check_same("stream=0")
     .check("k31c.region_exit(0)")
     .check_next("k31c.lightning_indexer(")
     .run(r.after))
    FileCheck().check_count("k31c.region_enter(", 1, exactly=True).run(r.after)
    assert all("region=0" in line for line in lines_with(r.after, "stream=1"))
    region, = r.record.result.stats["regions"]
    assert region == {"region": 0, "layer": 1, "query": 2, "key": 3, "weights": 2}


def test_an_indexer_already_in_a_region_is_left_alone(lit):
    r = lit.run("indexer_prolog", prior=PRIOR + ["indexer_prolog"])
    assert r.after == r.before and r.record.result.stats["left"] == 1
    assert r.record.result.notes[0] == ("%layers.1.self_attn.indexer/lightning_indexer: already in a region; "
                                        "left alone")                 # named as the dump names it
