"""Stand-ins for pass tests: one gated-MLA layer (with its lightning indexer) of the tiny config,
captured like a model step, plus real inputs for it (two requests with 20 cached tokens each, so
the top-16 indexer really selects)."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.export import Dim

from k31c.config import preset
from k31c.graph.blocks.mla import GatedMLA
from k31c.graph.capture import clone_graph, trace
from k31c.graph.step import MLALayerCache, step_meta
from k31c.passes.manager import make_context, resolve, run_pipeline

BLOCK, BLOCKS_PER_REQ, CACHED = 16, 4, 20


class MLALayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = GatedMLA(cfg)
        self.self_attn.reset_parameters(torch.Generator().manual_seed(3))

    def forward(self, x, meta, cache):
        return self.self_attn(x, cache, meta, "decode")


def tiny_cfg():
    return preset("tiny")


def step_inputs(cfg, batch=2, seed=0, fp8=False):
    """x, meta, cache for a decode step of `batch` requests at position CACHED."""
    g = torch.Generator().manual_seed(seed)
    nb = batch * BLOCKS_PER_REQ
    latent = torch.randn(nb, BLOCK, cfg.latent_dim, generator=g)
    if fp8:
        from k31c.graph.ops.cache_write import index_row_bytes
        index = torch.randint(0, 120, (nb, BLOCK * index_row_bytes(cfg.index_head_dim)), generator=g,
                              dtype=torch.uint8)
    else:
        index = torch.randn(nb, BLOCK, cfg.index_head_dim, generator=g)
    table = torch.arange(nb, dtype=torch.int32).view(batch, BLOCKS_PER_REQ)
    slots = table[:, CACHED // BLOCK].long() * BLOCK + CACHED % BLOCK
    meta = step_meta(slot_mapping=slots, block_table=table, row_req=torch.arange(batch),
                     row_len=torch.full((batch,), CACHED + 1), kda_slots=torch.arange(batch),
                     cu_seqlens=torch.arange(batch + 1))
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    return x, meta, MLALayerCache(latent, index)


def capture_layer(layer, cfg, fp8=False):
    """The layer's decode step as a graph (batch symbolic); returns (gm, weights)."""
    b = Dim("B", min=1)
    meta_spec = [{0: b}, {0: b}, {0: b}, {0: b}, {0: b}, {0: b + 1}]
    gm, inputs = trace(layer, step_inputs(cfg, fp8=fp8), ({0: b}, meta_spec, [None, None]),
                       ("x", "meta", "cache"))
    return gm, [i.tensor for i in inputs if i.is_weight]


def run_graph(gm, weights, x, meta, cache):
    """Run a graph on real inputs (the cache is written in place)."""
    import torch.utils._pytree as pytree
    with torch.no_grad():
        return gm(*weights, *pytree.tree_leaves((x, meta, cache)))[0]


def passes(gm, names=None, target="cpu", options=None, stop_after=None, disable=()):
    """Run a pipeline on a copy of `gm`; returns (graph, records, context)."""
    gm = clone_graph(gm)
    ctx = make_context(target, "test")
    records = run_pipeline(gm, resolve(names, options, disable=disable), ctx, stop_after=stop_after)
    return gm, records, ctx


def eager_and_graph(layer, gm, weights, cfg, batch=2, fp8=False):
    """Outputs and written caches of the eager layer and of the graph, on the same inputs."""
    x, meta, cache = step_inputs(cfg, batch=batch, fp8=fp8)
    cache2 = copy.deepcopy(cache)
    with torch.no_grad():
        ref = layer(x, meta, cache)
    got = run_graph(gm, weights, x, meta, cache2)
    return (ref, cache), (got, cache2)


def nodes(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_schema", None) is not None
            and n.target._schema.name.split("::")[-1] == name]
