"""Triton lowering of `k31c::lightning_indexer_topk`: the indexer's scan, then the top-k select.

indexer.py's scan writes the [N, L] fp32 scores to a workspace and, beside them, the largest order
key of each GROUP positions; topk.py's select reads the scores, its filter only the groups whose
maximum reaches a row's threshold (a few percent of a long row). A single fused kernel that
selected from scores computed in-kernel, never writing them out, was measured 2.6x slower at
128K and removed (BENCHMARKS.md, top-k).
"""
from __future__ import annotations

import torch

from k31c.lowering.registry import register
from k31c.lowering.targets import GPU_TARGETS
from k31c.lowering.triton import indexer, topk

_OP = "k31c::lightning_indexer_topk"
GROUP = 0            # positions per scan maximum (0: none; the filter reads every score)


@register(_OP, GPU_TARGETS)
def lightning_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                           block_table: torch.Tensor, row_req: torch.Tensor, row_len: torch.Tensor,
                           k: int) -> torch.Tensor:
    """topk_select(lightning_indexer(...), row_len, k) as the two Triton launchers: the scores
    and their group maxima live in workspaces between them (allocated per call from the caching
    allocator, so a CUDA graph capture keeps them in the graph's pool)."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if not GROUP:
        return topk.select(indexer.launch_indexer(q, weights, index_cache, block_table, row_req, row_len),
                           row_len, k)
    scores, maxima = indexer.launch_indexer(q, weights, index_cache, block_table, row_req, row_len,
                                            group=GROUP)
    return topk.select(scores, row_len, k, maxima, GROUP if maxima is not None else 0)


def aot_specs(shapes) -> list:
    """The launches for `k31c::lightning_indexer_topk` at `shapes` (aot_spec.AotShapes): the
    indexer's and the top-k's, with the group maxima, tagged with this op too."""
    return [s._replace(ops=tuple(dict.fromkeys((*s.ops, _OP))))
            for s in (*indexer.aot_specs(shapes, GROUP), *topk.aot_specs(shapes, GROUP))]
