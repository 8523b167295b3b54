"""Lit-style pass tests: a small graph in, one pass run, `torch.testing.FileCheck` on the
canonical text out (what `k31c inspect` prints and the dumps hold).

The input is the decode step of a two-layer model (layer 0 KDA with a dense MLP, layer 1 MLA with
its indexer and a MoE) captured once per session with weights on the meta device, taken after
the passes that precede the one under test."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.testing import FileCheck  # noqa: F401  (re-exported for the lit files)

from k31c.config import preset
from k31c.graph.capture import clone_graph
from k31c.graph.printer import format_graph
from k31c.cli.inspect import inspect_graph, shape_model
from k31c.passes.manager import PassRecord, make_context, resolve, run_pipeline

LIT_CONFIG = dict(num_hidden_layers=2, full_attn_layers=(2,))


@dataclass
class Lit:
    before: str                  # canonical text of the input graph
    after: str                   # ... and after the pass
    record: PassRecord
    gm: torch.fx.GraphModule     # the graph after the pass


class LitModel:
    def __init__(self):
        self.cfg = preset("tiny").replace(**LIT_CONFIG)
        self.model = shape_model(self.cfg)
        self._inputs = {}

    def graph(self, prior, step="decode", target="cpu", options=None):
        """The step's graph after the passes `prior` (a copy), and its symbol names."""
        key = (tuple(prior), step, target, repr(options))
        if key not in self._inputs:
            self._inputs[key] = inspect_graph(self.cfg, step, target=target, passes=list(prior),
                                              options=options, model=self.model)
        gm, captured = self._inputs[key]
        return clone_graph(gm), captured.dims

    def run(self, name, prior, step="decode", target="cpu", options=None, gm=None) -> Lit:
        """Run pass `name` on the graph after `prior` (or on `gm`, a graph from `graph`)."""
        dims = self.graph(prior, step, target)[1]
        if gm is None:
            gm = self.graph(prior, step, target)[0]
        before = format_graph(gm, dims=dims)
        ctx = make_context(target, "lit", dims=dims)
        record, = run_pipeline(gm, resolve([name], {name: options} if options else None), ctx)
        return Lit(before, format_graph(gm, dims=dims), record, gm)


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]
