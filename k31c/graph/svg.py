"""A graph as an SVG picture: one box per op, one lane per stream, regions and superkernels drawn.

Written by hand (no graphviz binary needed). Layout: ops top to bottom in graph order, each in
the lane of its stream (stream 0 leftmost); a region is a tinted band across all lanes from its
`region_enter` to its `region_exit`; a superkernel is a dashed outline around its ops; k31c ops
are orange, stream markers purple, dense ops white; edges between lanes (cross-stream uses) red.
"""
from __future__ import annotations

from typing import Optional
from xml.sax.saxutils import escape

import torch

from ..errors import UsageError
from .ops import is_k31c
from .ops.streams import is_marker
from .printer import node_names, op_name

ROW, LANE, BOX_W, BOX_H, TOP, LEFT = 22, 300, 270, 18, 60, 20
LANE_FILL = ["#f4f4f4", "#e8f0fb", "#e9f6ea", "#fbf3e4", "#f5e9f7"]
REGION_FILL = "#fff3b0"


def _meta(node) -> dict:
    return node.meta.get("k31c") or {}


def _label(name: str, limit: int = 44) -> str:
    text = name.lstrip("%")
    if len(text) > limit:
        text = "…" + text[-(limit - 1):]
    return text


def draw_svg(gm: torch.fx.GraphModule, title: str = "", layer: Optional[int] = None) -> str:
    names = node_names(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"
             and (layer is None or _meta(n).get("layer") == layer)]
    if not nodes:
        raise UsageError(f"no ops to draw{f' in layer {layer}' if layer is not None else ''}")
    row = {n: i for i, n in enumerate(nodes)}
    streams = sorted({_meta(n).get("stream", 0) for n in nodes})
    lane = {s: i for i, s in enumerate(streams)}
    width = LEFT * 2 + LANE * len(streams)
    height = TOP + ROW * len(nodes) + 20

    def x_of(n):
        return LEFT + lane[_meta(n).get("stream", 0)] * LANE + (LANE - BOX_W) // 2

    def y_of(n):
        return TOP + row[n] * ROW

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="10">',
           f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}</text>']
    for s, i in lane.items():
        x = LEFT + i * LANE
        out.append(f'<rect x="{x}" y="{TOP - 24}" width="{LANE - 4}" height="{height - TOP + 4}" '
                   f'fill="{LANE_FILL[s % len(LANE_FILL)]}"/>')
        out.append(f'<text x="{x + 6}" y="{TOP - 10}" font-size="12">stream {s}</text>')
    out += _regions(nodes, y_of, width)
    out += _superkernels(nodes, x_of, y_of)
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in row:
                continue
            x1, y1 = x_of(a) + BOX_W // 2, y_of(a) + BOX_H
            x2, y2 = x_of(n) + BOX_W // 2, y_of(n)
            cross = _meta(a).get("stream", 0) != _meta(n).get("stream", 0)
            colour, w = ("#d62728", 1.2) if cross else ("#9a9a9a", 0.6)
            out.append(f'<path d="M{x1},{y1} C{x1},{y1 + 12} {x2},{y2 - 12} {x2},{y2}" fill="none" '
                       f'stroke="{colour}" stroke-width="{w}"/>')
    out += _events(nodes, x_of, y_of)
    for n in nodes:
        meta = _meta(n)
        fill = "#e3c8f2" if is_marker(n.target) else ("#ffcc8a" if is_k31c(n) else "#ffffff")
        tip = escape(f"{names[n]} = {op_name(n.target)}  {meta}")
        out.append(f'<g><title>{tip}</title><rect x="{x_of(n)}" y="{y_of(n)}" width="{BOX_W}" '
                   f'height="{BOX_H}" rx="3" fill="{fill}" stroke="#555" stroke-width="0.6"/>'
                   f'<text x="{x_of(n) + 4}" y="{y_of(n) + 13}">{escape(_label(names[n]))}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _regions(nodes, y_of, width) -> list[str]:
    out, open_at = [], {}
    for n in nodes:
        name = op_name(n.target)
        if name == "k31c.region_enter":
            open_at[n.args[0]] = (n, n.args[1])
        elif name == "k31c.region_exit" and n.args[0] in open_at:
            start, kind = open_at.pop(n.args[0])
            y0, y1 = y_of(start) - 3, y_of(n) + BOX_H + 3
            out.append(f'<rect x="{LEFT - 8}" y="{y0}" width="{width - 2 * LEFT + 12}" height="{y1 - y0}" '
                       f'fill="{REGION_FILL}" fill-opacity="0.45" stroke="#c9a800" stroke-width="1"/>')
            layer = _meta(n).get("layer")
            where = f" (layer {layer})" if layer is not None else ""
            out.append(f'<text x="{width - LEFT - 4}" y="{y0 + 12}" text-anchor="end" font-size="11">'
                       f'region {n.args[0]}: {escape(str(kind))}{where}</text>')
    return out


def _superkernels(nodes, x_of, y_of) -> list[str]:
    spans: dict[int, list] = {}
    for n in nodes:
        sk = _meta(n).get("superkernel")
        if sk is not None:
            spans.setdefault(sk, []).append(n)
    out = []
    for sk, members in spans.items():
        x = x_of(members[0]) - 4
        y0, y1 = y_of(members[0]) - 2, y_of(members[-1]) + BOX_H + 2
        out.append(f'<rect x="{x}" y="{y0}" width="{BOX_W + 8}" height="{y1 - y0}" fill="none" '
                   f'stroke="#1f77b4" stroke-width="1.2" stroke-dasharray="4,3"/>')
        out.append(f'<text x="{x + BOX_W + 6}" y="{y0 + 10}" font-size="9" fill="#1f77b4" '
                   f'transform="rotate(90 {x + BOX_W + 6} {y0 + 10})">sk {sk}</text>')
    return out


def _events(nodes, x_of, y_of) -> list[str]:
    """Fork/join arrows: each event_record to the event_waits of the same event (purple, dashed)."""
    records, out = {}, []
    for n in nodes:
        name = op_name(n.target)
        if name == "k31c.event_record":
            records[n.args[0]] = n
        elif name == "k31c.event_wait" and n.args[0] in records:
            r = records[n.args[0]]
            x1, y1 = x_of(r) + BOX_W, y_of(r) + BOX_H // 2
            x2, y2 = x_of(n) + (BOX_W if x_of(n) == x_of(r) else 0), y_of(n) + BOX_H // 2
            bend = 24 if x2 == x1 else -24
            out.append(f'<path d="M{x1},{y1} C{x1 + 24},{y1} {x2 + bend},{y2} {x2},{y2}" fill="none" '
                       f'stroke="#8e44ad" stroke-width="1.4" stroke-dasharray="5,3"/>')
    return out
