"""Stream markers: the ops that give a graph its fork/join structure (DESIGN §3, §4).

Ops (namespace k31c), all without tensor inputs or outputs:
- `region_enter(region, kind)`: a stream region opens on the capturing stream (stream 0);
- `event_record(event, stream)`: `stream` records event `event` after its work so far;
- `event_wait(event, stream)`: `stream` waits for event `event` before its next work;
- `region_exit(region)`: the region closes; every side stream must have been joined.

A fork is `event_record(e, 0)` followed by `event_wait(e, s)` per side stream s; a join is
`event_record(e, s)` followed by `event_wait(e, 0)`. Which stream a node runs on is node metadata
(`node.meta["k31c"]["stream"]`); the markers carry their stream as an argument as well so a
serialized graph keeps its structure.

They do nothing on the CPU (one stream), so their reference implementation is empty. They are
registered as side-effecting so that FX dead-code elimination, export and Inductor keep them
although nothing uses their (absent) result.
"""
from __future__ import annotations

import torch


def _check_id(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@torch.library.custom_op("k31c::region_enter", mutates_args=())
def region_enter(region: int, kind: str) -> None:
    _check_id("region", region)
    if not kind:
        raise ValueError("kind must name the region (e.g. 'indexer_prolog')")


@region_enter.register_fake
def _(region, kind):
    _check_id("region", region)


@torch.library.custom_op("k31c::region_exit", mutates_args=())
def region_exit(region: int) -> None:
    _check_id("region", region)


@region_exit.register_fake
def _(region):
    _check_id("region", region)


@torch.library.custom_op("k31c::event_record", mutates_args=())
def event_record(event: int, stream: int) -> None:
    _check_id("event", event)
    _check_id("stream", stream)


@event_record.register_fake
def _(event, stream):
    _check_id("event", event)
    _check_id("stream", stream)


@torch.library.custom_op("k31c::event_wait", mutates_args=())
def event_wait(event: int, stream: int) -> None:
    _check_id("event", event)
    _check_id("stream", stream)


@event_wait.register_fake
def _(event, stream):
    _check_id("event", event)
    _check_id("stream", stream)


MARKERS = (torch.ops.k31c.region_enter.default, torch.ops.k31c.region_exit.default,
           torch.ops.k31c.event_record.default, torch.ops.k31c.event_wait.default)

for _op in MARKERS:
    torch.fx.node.has_side_effect(_op)


def is_marker(target) -> bool:
    """True for a stream marker op (an FX node's `target`)."""
    return target in MARKERS
