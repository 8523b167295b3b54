"""annotate_layers, lit-style: every op gets its decoder layer and block kind."""
import re

from lit_helpers import FileCheck


def test_layers_and_kinds(lit):
    r = lit.run("annotate_layers", prior=["canonicalize"])
    assert "kind=" not in r.before
    (FileCheck()
     .check("%embed_tokens/embedding = aten.embedding(").check_same("{kind=embed}")
     .check("%layers.0.input_layernorm/").check_same("{kind=norm, layer=0}")
     .check("%layers.0.self_attn/kda_decode = k31c.kda_decode(").check_same("{kind=kda, layer=0}")
     .check("%layers.0.mlp.down_proj/linear").check_same("{kind=mlp, layer=0}")
     .check("%layers.1.self_attn.indexer.wk/linear").check_same("{kind=mla, layer=1}")
     .check("%layers.1.self_attn/sparse_mla = k31c.sparse_mla(").check_same("{kind=mla, layer=1}")
     .check("%layers.1.block_sparse_moe.gate/moe_route = k31c.moe_route(").check_same("{kind=moe, layer=1}")
     .check("%layers.1.block_sparse_moe/moe_experts = k31c.moe_experts(").check_same("{kind=moe, layer=1}")
     .check("%lm_head/linear = aten.linear(").check_same("{kind=head}")
     .run(r.after))
    ops = [line for line in r.after.split("nodes:\n")[1].splitlines() if " = " in line]
    assert all("kind=" in line and "stream=0" in line for line in ops)
    for line in ops:                                       # the layer is the module path's
        if line.lstrip().startswith("%layers."):
            layer = re.search(r"%layers\.(\d+)", line).group(1)
            assert f"layer={layer}" in line
    stats = r.record.result.stats
    # no "residual": Block AttnRes' adds and mixes run inside the layer norms' attn_res_norm calls
    assert stats["ops"] == len(ops) and set(stats["kinds"]) == {"embed", "norm", "kda", "mlp", "mla", "moe",
                                                                "head"}
