"""indexer_prolog: the three independent branches feeding each lightning indexer, in one region
on three streams ("Indexer Prolog" of published K3.1 Pro graph-mode work).

Per indexer (one per MLA layer) the pass finds
- query   (stream 0): `wq_b` on the query latent c_q, the head split (and, later, its quantization);
- key     (stream 1): `wk`, the LayerNorm and the index-key cache write;
- weights (stream 2): `weights_proj` and its scale,
each as the nodes that feed nothing but that branch. The key and head-weight branches only need
the layer's normed input x, so they move up to just after x: on a GPU they start there and overlap
the q GEMMs of the main stream. The region is delimited explicitly:

    region_enter(r, "indexer_prolog")  event_record(fork, 0)
    event_wait(fork, 1)  <key branch>      event_record(join1, 1)
    event_wait(fork, 2)  <weights branch>  event_record(join2, 2)
    <stream 0: the MLA query path, the query branch, ...>
    event_wait(join1, 0)  event_wait(join2, 0)  region_exit(r)      <scoring>

The index-key write moves too; that is safe because the only reader of the index cache is the
scoring op after the join (checked: nothing the write jumps over touches that cache).
"""
from __future__ import annotations

import torch

from ..graph.printer import display_name
from .graph_utils import (INDEX_WRITES, INDEXER_OPS, K31C, exclusive_slice, info, insert_after,
                          region_of)
from .manager import PassResult, register_pass

SIDE_STREAMS = (("key", 1), ("weights", 2))


def _next_ids(graph: torch.fx.Graph) -> tuple[int, int]:
    regions = [n.args[0] for n in graph.nodes if n.target is K31C.region_enter.default]
    events = [n.args[0] for n in graph.nodes
              if n.target in (K31C.event_record.default, K31C.event_wait.default)]
    return max(regions, default=-1) + 1, max(events, default=-1) + 1


def _plan(consumer: torch.fx.Node, order: dict):
    """The three branches of one indexer, or a string saying why it is left alone."""
    def where() -> str:          # named only when left alone: naming walks the whole graph
        return display_name(consumer)
    q, weights, cache = consumer.args[0], consumer.args[1], consumer.args[2]
    writes = [u for u in cache.users if u.target in INDEX_WRITES and u.args[0] is cache]
    if len(writes) != 1:
        return f"{where()}: {len(writes)} index-key writes into its cache (need exactly 1); left alone"
    write = writes[0]
    if order[write] > order[consumer]:
        return f"{where()}: its keys are written after scoring; left alone"
    branches = {
        "query": exclusive_slice([q], consumer),
        "key": exclusive_slice(write.args[1:], write) + [write],
        "weights": exclusive_slice([weights], consumer),
    }
    side = [n for name, _ in SIDE_STREAMS for n in branches[name]]
    inputs = {a for n in side for a in n.all_input_nodes if a not in side}
    anchor = max(inputs, key=order.__getitem__)
    if anchor.op == "placeholder":
        anchor = [n for n in consumer.graph.nodes if n.op == "placeholder"][-1]
    jumped = [n for n in consumer.graph.nodes
              if order[anchor] < order[n] < order[write] and n not in side and cache in n.all_input_nodes]
    if jumped:
        return f"{where()}: {display_name(jumped[0])} uses the index cache before its write; left alone"
    return branches, anchor


def _place(consumer, branches, anchor, region: int, event: int, order: dict) -> None:
    marker = dict(like=consumer, region=region)
    # The region opens before the first branch op; the fork comes after the last input the side
    # branches need (so they can start at once), which may be after the query branch has begun.
    query = branches["query"]
    opened_after = query[0].prev if query and order[query[0]] < order[anchor] else anchor
    cursor = insert_after(opened_after, K31C.region_enter.default, (region, "indexer_prolog"),
                          stream=0, **marker)
    if order[anchor] > order[opened_after]:
        cursor = anchor
    cursor = insert_after(cursor, K31C.event_record.default, (event, 0), stream=0, **marker)
    joins = []
    for name, stream in SIDE_STREAMS:
        if not branches[name]:
            continue
        cursor = insert_after(cursor, K31C.event_wait.default, (event, stream), stream=stream, **marker)
        for node in branches[name]:
            cursor.append(node)
            cursor = node
            info(node).update(stream=stream, region=region, branch=name)
        join = event + 1 + len(joins)
        cursor = insert_after(cursor, K31C.event_record.default, (join, stream), stream=stream, **marker)
        joins.append(join)
    for node in branches["query"]:
        info(node).update(stream=0, region=region, branch="query")
    cursor = consumer.prev
    for join in joins:
        cursor = insert_after(cursor, K31C.event_wait.default, (join, 0), stream=0, **marker)
    insert_after(cursor, K31C.region_exit.default, (region,), stream=0, **marker)


@register_pass("indexer_prolog", stage="schedule", after=("canonicalize", "annotate_layers"))
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Put each indexer's query, key and head-weight branches in one region on three streams.
    stats: regions ([{region, layer, query, key, weights}]: ops per branch), left (indexers left alone)."""
    graph = gm.graph
    region, event = _next_ids(graph)
    notes, regions = [], []
    for consumer in [n for n in graph.nodes if n.target in INDEXER_OPS]:
        if region_of(consumer) is not None or any(region_of(a) is not None for a in consumer.all_input_nodes):
            notes.append(f"{display_name(consumer)}: already in a region; left alone")
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        plan = _plan(consumer, order)
        if isinstance(plan, str):
            notes.append(plan)
            continue
        branches, anchor = plan
        _place(consumer, branches, anchor, region, event, order)
        regions.append({"region": region, "layer": info(consumer).get("layer"),
                        **{name: len(nodes) for name, nodes in branches.items()}})
        event += 1 + sum(1 for name, _ in SIDE_STREAMS if branches[name])
        region += 1
    left = len(notes)                         # one note per indexer left alone
    notes.append(f"{len(regions)} indexer regions" +
                 "".join(f"; region {r['region']} (layer {r['layer']}): query {r['query']}, key {r['key']}, "
                         f"weights {r['weights']} ops" for r in regions))
    return PassResult(matches=len(regions), changed=bool(regions), notes=notes,
                      stats={"regions": regions, "left": left})
