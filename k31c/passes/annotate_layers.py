"""annotate_layers: `node.meta["k31c"] = {layer, kind, stream, region}` for every op.

`layer` is the decoder layer index from the module path (`layers.3...`), `kind` the block the op
belongs to: kda, mla (the indexer included), moe, mlp, norm (the layer's RMSNorms), residual
(AttnRes mixing and adds between blocks), embed, head. Every op starts on stream 0 outside any
region; indexer_prolog moves some to side streams.
"""
from __future__ import annotations

import torch

from ..graph.capture import module_classes, module_path
from .graph_utils import info, layer_of
from .manager import PassResult, register_pass

_BLOCKS = {"KimiDeltaAttention": "kda", "GatedMLA": "mla", "LightningIndexer": "mla",
           "LatentMoE": "moe", "GatedMLP": "mlp", "RMSNorm": "norm", "Embedding": "embed"}


def kind_of(node: torch.fx.Node) -> str:
    classes = module_classes(node)
    for cls in classes:                     # outermost block wins: a GatedMLP inside MoE is moe
        if cls in _BLOCKS:
            return _BLOCKS[cls]
        if cls == "Linear":                 # lm_head, or an AttnRes projection
            return "head" if module_path(node) == "lm_head" else "residual"
    if classes and classes[-1] in ("K31ForCausalLM", "_Step"):
        return "head"                       # the logits cast at the top level
    return "residual"                       # AttnRes mixing and adds between blocks


@register_pass("annotate_layers", stage="prepare", after=("canonicalize",))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Record each op's decoder layer, block kind, stream (0) and region (none).
    stats: ops (annotated), kinds ({kind: ops})."""
    count = changed = 0
    kinds: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        meta = info(node)
        new = {"layer": layer_of(node), "kind": kind_of(node)}
        new.setdefault("region", meta.get("region"))
        if any(meta.get(k) != v for k, v in new.items()):
            changed += 1
        meta.update(new)
        kinds[new["kind"]] = kinds.get(new["kind"], 0) + 1
        count += 1
    return PassResult(matches=count, changed=changed > 0, notes=[f"annotated {count} ops"],
                      stats={"ops": count, "kinds": dict(sorted(kinds.items()))})
