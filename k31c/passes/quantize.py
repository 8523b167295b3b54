"""quantize: number formats of the MLA caches and (as an option) MXFP8 indexer q/k.

Cache formats are decided by the cache tensors the runtime allocates (runtime/kv.py), not by the
graph: every op reads its format from its cache tensor. Index cache: uint8 = FP8 keys (128 e4m3
values + one fp32 scale per 128 values: 132 B/token at d = 128), float8_e4m3fn = MXFP8 keys (e4m3 +
one E8M0 byte per 32 values), a float one = keys in its dtype. Latent cache: uint8 = the FP8
latent layout (`fp8_ds_mla`: c_kv e4m3 + fp32 scale per 128 values, k_rope bf16: 656 B/token at
K3 sizes), a float one = rows in its dtype. The pass records the format on every op that writes or
reads them (`index_cache=fp8|mxfp8|bf16|f32`, `latent_cache=fp8|bf16|f32`) and validates the
layouts against the row widths (graph/ops/fp8_layouts.py has them).

Options (all off by default, so the default graph is unchanged):
- `latent_cache` ("auto" | "model" | "fp8"): the latent format this compile is for. "auto" takes
  whatever the pool allocated; "fp8" / "model" are checked against the captured caches (a
  mismatch is a UsageError naming the pool argument), and `Engine(compiled)` allocates its pool
  in that format (`CompiledModel.cache_formats`).
- `index_cache` ("auto" | "bf16" | "fp8"): the same for the index keys. "fp8" (e4m3 + one fp32
  scale per 128 values, 132 B a token at d = 128) is the layout the h200 warp-specialized scan and
  the fused select read (with 64-key blocks: `Engine(compiled, block_size=64)`); not with
  `mxfp8_indexer`, which asks for an MXFP8 index cache itself.
- `mxfp8_indexer` (bool): MXFP8 index keys and queries (groups of 32 values along the head dim
  share one power-of-two scale 2^ceil(log2(amax / 448)), values e4m3). With an MXFP8 index cache
  (`Engine(compiled)` allocates one) the ops do it: the write quantises the keys, the scoring
  kernel quantises q on chip and takes four partial dots per 128-wide key; the graph is not
  changed. With any other index cache it is emulated in the graph: a `mxfp8_quant_dequant` node
  in front of the scoring op's q and one between the key LayerNorm and the cache write (a fused
  index_key_norm_write is split back into LayerNorm → mxfp8_quant_dequant → index_cache_write).
"""
from __future__ import annotations

import torch

from ..graph.ops.cache_write import index_cache_block_size
from ..graph.ops.fp8_layouts import MX_GROUP, latent_fp8_nope, mxfp8_quant_dequant
from ..errors import InputError, UsageError
from ..graph.printer import display_name, dtype_name
from .graph_utils import INDEX_WRITES, INDEXER_OPS, K31C, info, inherit, insert_after
from .manager import PassResult, register_pass

LATENT_FORMATS = ("auto", "model", "fp8")
INDEX_FORMATS = ("auto", "bf16", "fp8")       # bf16: float keys in the model dtype (CachePool's name)


def _cache_format(cache: torch.fx.Node, width: int) -> str:
    val = cache.meta.get("val")
    if val is None:
        return "unknown"
    if val.dtype in (torch.uint8, torch.float8_e4m3fn):
        fmt = "fp8" if val.dtype == torch.uint8 else "mxfp8"
        try:
            index_cache_block_size(val, width, cache.meta.get("k31c_input", cache.name))
        except ValueError as e:
            raise InputError(f"quantize: {fmt.upper()} index cache {display_name(cache)} does not fit {width}-wide "
                             f"keys: {e}") from None
        return fmt
    return dtype_name(val.dtype)


def _latent_format(write: torch.fx.Node) -> str:
    cache, rows = write.args[0], write.args[1]
    val = cache.meta["val"]
    if val.dtype != torch.uint8:
        return dtype_name(val.dtype)
    try:
        latent_fp8_nope(int(val.shape[2]), _width(rows), display_name(cache))
    except ValueError as e:
        raise InputError(f"quantize: FP8 latent cache: {e}") from None
    return "fp8"


def _check_pool_choice(option: str, want: str, choices: tuple, found: set, accepts) -> None:
    """The pool's cache formats `found` against the format the option asks for (`accepts`: which
    found formats that choice takes); "auto" takes whatever the pool has."""
    if want not in choices:
        raise UsageError(f"quantize: option {option} must be one of {choices}, got {want!r}")
    if want == "auto":
        return
    bad = sorted(f for f in found if not accepts(f))
    if bad:
        what = option.split("_")[0]
        raise UsageError(f"quantize: option {option}={want!r} but the pool's {what} cache is "
                         f"{', '.join(bad)}; allocate it with CachePool(..., {option}={want!r}) "
                         f"(Engine(compiled) does so)")


def _check_latent_choice(want: str, found: set) -> None:
    _check_pool_choice("latent_cache", want, LATENT_FORMATS, found,
                       lambda f: (f == "fp8") == (want == "fp8"))


def _check_index_choice(want: str, mxfp8: bool, found: set) -> None:
    if want in INDEX_FORMATS and want != "auto" and mxfp8:
        raise UsageError(f"quantize: options index_cache={want!r} and mxfp8_indexer=True ask for two index "
                         "caches; mxfp8_indexer allocates an MXFP8 one: give one of them")
    floats = {"bf16", "f16", "f32"}
    _check_pool_choice("index_cache", want, INDEX_FORMATS, found,
                       lambda f: f == "fp8" if want == "fp8" else f in floats)


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
               options={"mxfp8_indexer": False, "latent_cache": "auto", "index_cache": "auto"})
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Record and validate cache formats; check the requested latent and index formats; MXFP8 indexer q/k by
    the ops (MXFP8 index cache) or emulated by quant-dequant nodes.
    stats: index_cache, latent_cache (sorted formats seen), mxfp8_nodes (quant-dequant nodes
    inserted), split_writes (fused index writes split back for MXFP8)."""
    graph, notes = gm.graph, []
    opts = ctx.opts("quantize")
    mxfp8 = opts.get("mxfp8_indexer", False)
    formats, split, inserted = {}, 0, 0
    for node in list(graph.nodes):
        if node.target in INDEX_WRITES:
            fmt = _cache_format(node.args[0], _width(node.args[1]))
        elif node.target in INDEXER_OPS:
            fmt = _cache_format(node.args[2], _width(node.args[0]))
        elif node.target is K31C.mla_cache_write.default:
            info(node)["latent_cache"] = _latent_format(node)
            formats.setdefault("latent", set()).add(info(node)["latent_cache"])
            continue
        else:
            continue
        info(node)["index_cache"] = fmt
        formats.setdefault("index", set()).add(fmt)
        if not mxfp8 or fmt == "mxfp8":     # an MXFP8 cache: the ops quantise q and k themselves
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
    _check_latent_choice(opts.get("latent_cache", "auto"), formats.get("latent", set()))
    _check_index_choice(opts.get("index_cache", "auto"), mxfp8, formats.get("index", set()))
    for what, fmts in sorted(formats.items()):
        notes.append(f"{what} cache: {', '.join(sorted(fmts))}")
    if mxfp8 and "mxfp8" in formats.get("index", ()):
        notes.append("mxfp8 indexer q/k: by the ops on the MXFP8 index cache (q quantised in the kernel)")
    if mxfp8 and inserted:
        notes.append(f"mxfp8 indexer q/k: emulated, {inserted} quant-dequant nodes (the index cache is not "
                     "MXFP8: allocate CachePool(..., index_cache='mxfp8') for the kernel)"
                     + (f"; split {split} fused index writes" if split else ""))
    return PassResult(matches=sum(len(f) for f in formats.values()) + inserted,
                      changed=True if formats or inserted else False, notes=notes,
                      stats={**{f"{what}_cache": sorted(fmts) for what, fmts in sorted(formats.items())},
                             "mxfp8_nodes": inserted, "split_writes": split})
