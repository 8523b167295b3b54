"""merge_projections, lit-style: the linears that read one x become one k31c.linear_group, on a
target with the kernel (h200); never across streams or stream regions; nothing on the CPU."""
from lit_helpers import FileCheck, lines_with

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write",
         "fuse_lightning_indexer", "quantize"]


def test_groups_the_projections_of_one_input(lit):
    r = lit.run("merge_projections", prior=PRIOR, target="h200")
    FileCheck().check("aten.linear(").check_not("k31c.linear_group(").run(r.before)
    FileCheck().check_not("aten.linear(").run(r.after)
    (FileCheck()
     .check("%layers.0.self_attn.q_proj/linear_group = k31c.linear_group(%layers.0.input_layernorm/mul#1, "
            "[@layers.0.self_attn.q_proj.weight, @layers.0.self_attn.k_proj.weight, "
            "@layers.0.self_attn.v_proj.weight, @layers.0.self_attn.f_a_proj.weight, "
            "@layers.0.self_attn.b_proj.weight, @layers.0.self_attn.g_proj.weight])")
     .check_same("merged=6")
     # f_b reads f_a's output: a group of its own, fed by the first group's getitem
     .check("k31c.linear_group(%layers.0.self_attn.f_a_proj/getitem, [@layers.0.self_attn.f_b_proj.weight])")
     .check("k31c.kda_decode(%layers.0.self_attn.q_proj/getitem, %layers.0.self_attn.k_proj/getitem")
     .check("k31c.linear_group(%layers.0.post_attention_layernorm/getitem, [@layers.0.mlp.gate_proj.weight, "
            "@layers.0.mlp.up_proj.weight])")
     .check("k31c.linear_group(%layers.1.input_layernorm/getitem#1, [@layers.1.self_attn.q_a_proj.weight, "
            "@layers.1.self_attn.kv_a_proj_with_mqa.weight, @layers.1.self_attn.g_proj.weight])")
     .check("k31c.linear_group(%layers.1.post_attention_layernorm/getitem#1, "
            "[@layers.1.block_sparse_moe.routed_expert_down_proj.weight, "
            "@layers.1.block_sparse_moe.shared_experts.gate_proj.weight, "
            "@layers.1.block_sparse_moe.shared_experts.up_proj.weight])")
     .check("%lm_head/linear_group = k31c.linear_group(")
     .run(r.after))
    stats = r.record.result.stats
    assert stats["largest"] == 6 and stats["linears"] == len(lines_with(r.before, "aten.linear("))


def test_never_merges_across_streams_or_regions(lit):
    r = lit.run("merge_projections", prior=PRIOR, target="h200")
    # the indexer's key and weights projections read the layer input like q_a/kv_a/g, but run on
    # the prolog's side streams: each stays a group of one on its stream
    wk, = lines_with(r.after, "[@layers.1.self_attn.indexer.wk.weight]")
    weights, = lines_with(r.after, "[@layers.1.self_attn.indexer.weights_proj.weight]")
    assert "stream=1" in wk and "stream=2" in weights
    # the indexer's query projection reads c_q like q_b, inside the prolog region: not merged
    q_b, = lines_with(r.after, "[@layers.1.self_attn.q_b_proj.weight]")
    assert "indexer" not in q_b and "merged=1" in q_b


def test_singles_off_keeps_lone_linears(lit):
    r = lit.run("merge_projections", prior=PRIOR, target="h200", options={"singles": False})
    FileCheck().check("%lm_head/linear = aten.linear(").run(r.after)
    assert all("merged=1" not in line for line in lines_with(r.after, "k31c.linear_group("))
    assert r.record.result.stats["groups"] == len(lines_with(r.after, "k31c.linear_group("))


def test_no_kernel_no_change(lit):
    r = lit.run("merge_projections", prior=PRIOR, target="cpu")
    assert r.after == r.before and not r.record.result.changed
    assert r.record.result.notes == ["no linear_group kernel on cpu: linears kept"]
