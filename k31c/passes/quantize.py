"""quantize: number formats of the MLA caches and (as an option) MXFP8 indexer q/k.

Cache formats are decided by the cache tensors the runtime allocates, not by the graph: a uint8
index cache holds FP8 keys (128 e4m3 values + one fp32 scale per 128 values: 132 B/token at
d = 128), a float one holds keys in its dtype. The pass records the format on every op that
writes or scores index keys (`index_cache=fp8` / `bf16` / `f32`) and on the latent writes
(`latent_cache=...`), and validates the FP8 layout against the key width. FP8 latent rows are
not in the op set yet (mla_cache_write takes float caches); the pass reports the latent format.

Option `mxfp8_indexer` (default off): a graph rewrite that quantise-dequantises the indexer query
and key in MXFP8 before scoring: groups of 32 values along the head dim share one power-of-two
(E8M0) scale 2^ceil(log2(amax / 448)) (the scale is rounded up, so no value saturates), values
are e4m3. It models what an FP8 block-scaled scoring kernel computes. The query gets a
`mxfp8_quant_dequant` node in front of the scoring op; the key gets one between its LayerNorm and
the cache write. No fused kernel implements MXFP8 keys, so a fused index_key_norm_write is split
back into LayerNorm → mxfp8_quant_dequant → index_cache_write (reported).
"""
from __future__ import annotations

import torch

from ..graph.ops.cache_write import index_cache_block_size
from ..errors import InputError, UsageError
from ..graph.printer import display_name, dtype_name
from .graph_utils import INDEX_WRITES, INDEXER_OPS, K31C, info, inherit, insert_after
from .manager import PassResult, register_pass

MX_GROUP = 32
E4M3_MAX = 448.0


def mxfp8_quant_dequant(x: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """x quantised to MXFP8 along its last dim (e4m3 values, one E8M0 scale per `group`) and back."""
    d = x.shape[-1]
    g = x.float().unflatten(-1, (d // group, group))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    values = (g / scale).to(torch.float8_e4m3fn).float()
    return (values * scale).flatten(-2).to(x.dtype)


def _cache_format(cache: torch.fx.Node, width: int) -> str:
    val = cache.meta.get("val")
    if val is None:
        return "unknown"
    if val.dtype == torch.uint8:
        try:
            index_cache_block_size(val, width, cache.meta.get("k31c_input", cache.name))
        except ValueError as e:
            raise InputError(f"quantize: FP8 index cache {display_name(cache)} does not fit {width}-wide "
                             f"keys: {e}") from None
        return "fp8"
    return dtype_name(val.dtype)


def _check_group(node: torch.fx.Node, width: int) -> None:
    if width % MX_GROUP:
        raise UsageError(f"quantize: mxfp8_indexer needs the index head dim to be a multiple of "
                         f"{MX_GROUP}; {display_name(node)} has {width}")


def _width(node: torch.fx.Node) -> int:
    return int(node.meta["val"].shape[-1])


def _split_fused_write(write: torch.fx.Node) -> torch.fx.Node:
    """index_key_norm_write → layer_norm + index_cache_write; returns the layer_norm node."""
    cache, k_pre, weight, bias, slots, eps = write.args
    graph = write.graph
    with graph.inserting_before(write):
        x = graph.call_function(torch.ops.aten.to.dtype, (k_pre, torch.float32))
        ln = graph.call_function(torch.ops.aten.layer_norm.default, (x, [_width(k_pre)], weight, bias, eps))
        plain = graph.call_function(K31C.index_cache_write.default, (cache, ln, slots))
    for new in (x, ln, plain):
        inherit(new, write)
        new.meta["k31c"].pop("fused", None)
    x.meta["val"] = k_pre.meta["val"].float()
    ln.meta["val"] = x.meta["val"]
    plain.meta["val"] = None
    graph.erase_node(write)
    return ln


@register_pass("quantize", stage="rewrite", after=("fuse_index_write", "fuse_lightning_indexer"),
               options={"mxfp8_indexer": False})
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Record and validate cache formats; optionally MXFP8 quant-dequant of indexer q and k.
    stats: index_cache, latent_cache (sorted formats seen), mxfp8_nodes (quant-dequant nodes
    inserted), split_writes (fused index writes split back for MXFP8)."""
    graph, notes = gm.graph, []
    mxfp8 = ctx.opts("quantize").get("mxfp8_indexer", False)
    formats, split, inserted = {}, 0, 0
    for node in list(graph.nodes):
        if node.target in INDEX_WRITES:
            fmt = _cache_format(node.args[0], _width(node.args[1]))
        elif node.target in INDEXER_OPS:
            fmt = _cache_format(node.args[2], _width(node.args[0]))
        elif node.target is K31C.mla_cache_write.default:
            info(node)["latent_cache"] = dtype_name(node.args[0].meta["val"].dtype)
            formats.setdefault("latent", set()).add(info(node)["latent_cache"])
            continue
        else:
            continue
        info(node)["index_cache"] = fmt
        formats.setdefault("index", set()).add(fmt)
        if not mxfp8:
            continue
        if node.target in INDEXER_OPS:
            q = node.args[0]
            _check_group(node, _width(q))
            new = insert_after(q, mxfp8_quant_dequant, (q,), like=q)
            new.meta["val"] = q.meta["val"]
            node.replace_input_with(q, new)
            inserted += 1
        else:
            if node.target is K31C.index_key_norm_write.default:
                keys = _split_fused_write(node)
                split += 1
            else:
                keys = node.args[1]
            write = next(iter(u for u in keys.users if u.target is K31C.index_cache_write.default))
            _check_group(write, _width(keys))
            new = insert_after(keys, mxfp8_quant_dequant, (keys,), like=keys)
            new.meta["val"] = keys.meta["val"]
            write.replace_input_with(keys, new)
            inserted += 1
    for what, fmts in sorted(formats.items()):
        notes.append(f"{what} cache: {', '.join(sorted(fmts))}")
    if "latent" in formats:
        notes.append("FP8 latent rows: not in the op set (mla_cache_write takes float caches)")
    if mxfp8:
        notes.append(f"mxfp8 indexer q/k: {inserted} quant-dequant nodes"
                     + (f"; split {split} fused index writes (no fused MXFP8 key-write op)" if split else ""))
    return PassResult(matches=sum(len(f) for f in formats.values()) + inserted,
                      changed=True if formats or inserted else False, notes=notes,
                      stats={**{f"{what}_cache": sorted(fmts) for what, fmts in sorted(formats.items())},
                             "mxfp8_nodes": inserted, "split_writes": split})
