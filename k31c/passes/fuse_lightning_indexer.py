"""fuse_lightning_indexer: score + head weighting + top-k as one op.

    scores = k31c.lightning_indexer(q, w, cache, block_table, row_req, row_len)
    idx    = k31c.topk_select(scores, row_len, k)
becomes
    idx    = k31c.lightning_indexer_topk(q, w, cache, block_table, row_req, row_len, k)

so a kernel never writes the [rows, keys] score matrix to memory. Left alone: scores with other
users, or a top-k whose row lengths are not the scoring's (a different visibility rule).
"""
from __future__ import annotations

import torch

from ..graph.printer import display_name
from .graph_utils import K31C, inherit, stream_of
from .manager import PassResult, register_pass


@register_pass("fuse_lightning_indexer", stage="rewrite", after=("indexer_prolog",))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Replace lightning_indexer → topk_select by lightning_indexer_topk.
    stats: fused, left (scoring → top-k pairs left unfused)."""
    graph, fused, notes = gm.graph, 0, []
    for topk in [n for n in graph.nodes if n.target is K31C.topk_select.default]:
        scores, row_len, k = topk.args
        if not (isinstance(scores, torch.fx.Node) and scores.target is K31C.lightning_indexer.default):
            continue
        q, w, cache, block_table, row_req, score_len = scores.args
        why = None
        if len(scores.users) != 1:
            why = "the scores have other users"
        elif score_len is not row_len:
            why = "top-k and scoring use different row lengths"
        elif stream_of(scores) != stream_of(topk):
            why = "scoring and top-k are on different streams"
        if why:
            notes.append(f"{display_name(topk)}: not fused: {why}")
            continue
        with graph.inserting_before(topk):
            new = graph.call_function(K31C.lightning_indexer_topk.default,
                                      (q, w, cache, block_table, row_req, row_len, k))
        inherit(new, topk, fused="lightning_indexer+topk_select")
        new.meta["val"] = topk.meta.get("val")
        topk.replace_all_uses_with(new)
        graph.erase_node(topk)
        graph.erase_node(scores)
        fused += 1
    left = len(notes)                     # one note per site left alone
    notes.insert(0, f"fused {fused} indexer score + top-k pairs")
    return PassResult(matches=fused, changed=fused > 0, notes=notes,
                      stats={"fused": fused, "left": left})
