"""verify: the graph after the passes is still well formed.

- Fake tensors are propagated again through the whole graph; every op must still accept its
  inputs and keep the shape and dtype it had when captured (new ops just get theirs).
- Stream order is checked with one vector clock per stream: an op may use a value (or a cache
  another op writes) from another stream only after an event recorded after that value was made
  and waited for on its own stream. Every region is joined at its exit (each side stream's work
  happens before `region_exit`), side streams are only used inside regions, regions are closed.
- Every cache (any value written in place) is written by one op only.
- A superkernel's ops share one stream and region.
Errors name nodes as the dumps do (`printer.display_name`); the pass never changes the graph.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import GraphVerificationError
from ..graph.printer import display_name
from .graph_utils import K31C, is_marker_node, mutated_args, region_of, stream_of
from .manager import PassResult, register_pass


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.dim() != b.dim():
            return False
        return all((x.node.expr if isinstance(x, torch.SymInt) else x)
                   == (y.node.expr if isinstance(y, torch.SymInt) else y) for x, y in zip(a.shape, b.shape))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return True


def repropagate(gm: torch.fx.GraphModule) -> int:
    """Fake-run the graph; returns how many ops were checked against their captured metadata."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    if any(v is None for v in vals):
        raise GraphVerificationError("verify: a graph input has no fake value to propagate")
    before = {n: n.meta.get("val") for n in gm.graph.nodes if n.op == "call_function"}
    mode = detect_fake_mode(vals)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
    except Exception as e:
        raise GraphVerificationError(f"verify: fake propagation failed: {e}") from e
    checked = 0
    for node, old in before.items():
        if old is None:
            continue
        if not _same(old, node.meta.get("val")):
            raise GraphVerificationError(f"verify: {display_name(node)} changed its result from {old} to "
                                         f"{node.meta.get('val')}")
        checked += 1
    return checked


class _Clocks:
    """Happens-before over streams: one vector clock per stream, events carry snapshots."""

    def __init__(self):
        self.clock = defaultdict(lambda: defaultdict(int))
        self.stamp, self.events = {}, {}

    def tick(self, node, stream):
        c = self.clock[stream]
        c[stream] += 1
        self.stamp[node] = (stream, c[stream])

    def before(self, node, stream) -> bool:
        """Did `node` happen before the next op on `stream`?"""
        s, t = self.stamp[node]
        return s == stream or self.clock[stream][s] >= t


def check_streams(gm: torch.fx.GraphModule) -> int:
    clocks, open_regions, used = _Clocks(), {}, defaultdict(dict)
    accessed = defaultdict(list)            # value written somewhere -> ops that used it so far
    written = {n for node in gm.graph.nodes for n in mutated_args(node)}
    writers = defaultdict(list)
    regions = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            for s, c in list(clocks.clock.items()):
                if s != 0 and clocks.clock[0][s] < c[s]:
                    raise GraphVerificationError(f"verify: stream {s} is never joined back to stream 0")
            if open_regions:
                raise GraphVerificationError(f"verify: regions {sorted(open_regions)} are never exited")
            continue
        if node.op != "call_function":
            continue
        s = stream_of(node)
        if is_marker_node(node):
            _check_marker(node, s, clocks, open_regions, used)
            regions += node.target is K31C.region_exit.default
            continue
        for a in node.all_input_nodes:
            if a in clocks.stamp and not clocks.before(a, s):
                raise GraphVerificationError(f"verify: {display_name(node)} (stream {s}) uses {display_name(a)} from stream "
                                             f"{stream_of(a)} without waiting for an event after it")
            if a in written:
                for other in accessed[a]:
                    if (mutated_args(other) or a in mutated_args(node)) and not clocks.before(other, s):
                        raise GraphVerificationError(
                            f"verify: {display_name(node)} (stream {s}) and {display_name(other)} (stream {stream_of(other)}) "
                            f"both use {display_name(a)}, which one of them writes, without an event between them")
                accessed[a].append(node)
        for a in mutated_args(node):
            writers[a].append(node)
        clocks.tick(node, s)
        r = region_of(node)
        if s != 0 and r is None:
            raise GraphVerificationError(f"verify: {display_name(node)} runs on stream {s} outside any region")
        if r is not None:
            if r not in open_regions:
                raise GraphVerificationError(f"verify: {display_name(node)} is in region {r}, which is not open here")
            used[r][s] = node
    for value, ops in writers.items():
        if len(ops) > 1:
            raise GraphVerificationError(f"verify: {display_name(value)} is written by {len(ops)} ops "
                                         f"({', '.join(display_name(o) for o in ops)}); each cache is written once")
    return regions


def _check_marker(node, s, clocks: _Clocks, open_regions, used) -> None:
    target, args = node.target, node.args
    if target in (K31C.event_record.default, K31C.event_wait.default) and args[1] != s:
        raise GraphVerificationError(f"verify: {display_name(node)} names stream {args[1]} but is placed on "
                                     f"stream {s}")
    clocks.tick(node, s)
    if target is K31C.event_record.default:
        clocks.events[args[0]] = dict(clocks.clock[s])
        if node.meta.get("k31c", {}).get("region") is not None:
            used[node.meta["k31c"]["region"]][s] = node
    elif target is K31C.event_wait.default:
        if args[0] not in clocks.events:
            raise GraphVerificationError(f"verify: {display_name(node)} waits for event {args[0]}, never "
                                         "recorded before")
        for stream, t in clocks.events[args[0]].items():
            clocks.clock[s][stream] = max(clocks.clock[s][stream], t)
    elif target is K31C.region_enter.default:
        if s != 0 or args[0] in open_regions:
            raise GraphVerificationError(f"verify: {display_name(node)} opens region {args[0]} twice or off stream 0")
        open_regions[args[0]] = node
    elif target is K31C.region_exit.default:
        r = args[0]
        if r not in open_regions:
            raise GraphVerificationError(f"verify: {display_name(node)} exits region {r}, which is not open")
        for stream, last in used[r].items():
            if stream != 0 and not clocks.before(last, 0):
                raise GraphVerificationError(f"verify: region {r} exits before stream {stream} is joined "
                                             f"(last op {display_name(last)})")
        del open_regions[r]


def check_superkernels(gm: torch.fx.GraphModule) -> int:
    where = {}
    for node in gm.graph.nodes:
        sk = (node.meta.get("k31c") or {}).get("superkernel")
        if sk is None:
            continue
        place = (stream_of(node), region_of(node))
        if where.setdefault(sk, place) != place:
            raise GraphVerificationError(f"verify: superkernel {sk} spans streams/regions {where[sk]} and "
                                         f"{place} (at {display_name(node)})")
    return len(where)


@register_pass("verify", stage="verify")
def run(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Re-propagate fake tensors; check stream order, joined regions, single writers, superkernels.
    stats: ops (re-propagated), regions (joined), superkernels (checked)."""
    checked = repropagate(gm)
    regions = check_streams(gm)
    kernels = check_superkernels(gm)
    return PassResult(matches=checked, changed=False,
                      stats={"ops": checked, "regions": regions, "superkernels": kernels},
                      notes=[f"{checked} ops re-propagated; {regions} regions joined; {kernels} superkernels "
                             "on one stream each"])
