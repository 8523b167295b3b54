"""fuse_index_write: LayerNorm → (FP8 quantize) → cache write of the index key as one op.

    keys = aten.layer_norm(k_pre[.float()], [d], w, b, eps)
    k31c.index_cache_write(cache, keys, slot_mapping)
becomes
    k31c.index_key_norm_write(cache, k_pre, w, b, slot_mapping, eps)

The FP8 quantization is inside the write already (a uint8 cache selects it), so the fused op
covers LayerNorm + quantize + write. The fused op normalizes in fp32 itself, so a `.float()` cast
feeding the LayerNorm is absorbed too. Left alone: a LayerNorm with other users, without affine
parameters, over more than the last dim, or on another stream than the write.
"""
from __future__ import annotations

import torch

from ..graph.printer import display_name
from .graph_utils import K31C, inherit, stream_of
from .manager import PassResult, register_pass

aten = torch.ops.aten


def _layer_norm_args(ln: torch.fx.Node):
    args = list(ln.args) + [None] * (5 - len(ln.args))
    x, shape, weight, bias, eps = args[:5]
    weight = ln.kwargs.get("weight", weight)
    bias = ln.kwargs.get("bias", bias)
    eps = ln.kwargs.get("eps", 1e-5 if eps is None else eps)
    return x, shape, weight, bias, eps


@register_pass("fuse_index_write", stage="rewrite", after=("canonicalize", "indexer_prolog"))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Replace LayerNorm → index_cache_write by index_key_norm_write.
    stats: fused, left (writes of a LayerNorm left unfused)."""
    graph, fused, notes = gm.graph, 0, []
    for write in [n for n in graph.nodes if n.target is K31C.index_cache_write.default]:
        cache, keys, slots = write.args
        if not (isinstance(keys, torch.fx.Node) and keys.target is aten.layer_norm.default):
            continue
        x, shape, weight, bias, eps = _layer_norm_args(keys)
        d = keys.meta["val"].shape[-1] if "val" in keys.meta else None
        why = None
        if len(keys.users) != 1:
            why = "the normalized key has other users"
        elif weight is None or bias is None:
            why = "the LayerNorm has no affine parameters"
        elif list(shape) != [d]:
            why = f"the LayerNorm is over {list(shape)}, not the last dim"
        elif stream_of(keys) != stream_of(write):
            why = f"the LayerNorm (stream {stream_of(keys)}) and the write (stream {stream_of(write)}) differ"
        if why:
            notes.append(f"{display_name(write)}: not fused: {why}")
            continue
        cast = x if (isinstance(x, torch.fx.Node) and x.target is aten.to.dtype and len(x.users) == 1
                     and x.args[1] == torch.float32) else None
        k_pre = cast.args[0] if cast is not None else x
        with graph.inserting_before(write):
            new = graph.call_function(K31C.index_key_norm_write.default,
                                      (cache, k_pre, weight, bias, slots, float(eps)))
        inherit(new, write, fused="layer_norm+index_cache_write")
        new.meta["val"] = None
        graph.erase_node(write)
        graph.erase_node(keys)
        if cast is not None:
            graph.erase_node(cast)
        fused += 1
    left = len(notes)                     # one note per site left alone
    notes.insert(0, f"fused {fused} index-key writes")
    return PassResult(matches=fused, changed=fused > 0, notes=notes,
                      stats={"fused": fused, "left": left})
