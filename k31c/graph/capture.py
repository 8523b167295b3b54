"""Capture: one step of the model as an FX graph over aten + k31c ops (DESIGN §1).

A step kind (prefill, decode, or verification with R rows per request) is traced once by
`torch.export` (non-strict: the Python code runs on fake tensors, so nothing is executed and no
cache is written) into the pre-dispatch aten IR. Why export rather than a Dynamo backend:
- the cache-writing k31c ops stay in place as they are (no `auto_functionalized` to match through);
- the example is synthetic with B >= 2 requests (`example_sizes`) and the batch dimension is a
  `Dim` with min 1, so the one trace serves every batch size, B = 1 included (Dynamo specializes
  sizes 0/1);
- the trace is reusable: every pass pipeline starts from a copy of it.
`torch.compile(model, backend="k31c")` reaches the same passes through `dynamo_to_aten` (api.py).

The graph takes the weights first (lifted, named by their module path) and then the flattened
step inputs `(input_ids, meta, caches)`; it returns `(logits,)` and writes the caches in place.
"""
from __future__ import annotations

import contextlib
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from .model import K31ForCausalLM
from .step import Caches, KDASnapshots, StepMeta, step_meta

STEP_MODES = ("prefill", "decode")


@dataclass(frozen=True)
class StepKind:
    """What one captured graph computes: prefill, or decode with `rows` rows per request."""
    mode: str
    rows: int = 1

    def __post_init__(self):
        if self.mode not in STEP_MODES:
            raise ValueError(f"mode must be one of {STEP_MODES}, got {self.mode!r}")
        if not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"rows must be a positive integer, got {self.rows!r}")
        if self.mode == "prefill" and self.rows != 1:
            raise ValueError(f"prefill steps have rows=1, got {self.rows}")

    @classmethod
    def parse(cls, name: str) -> "StepKind":
        """The step kind a name means: "prefill", "decode", or "verifyR" (R rows per request)."""
        if name in STEP_MODES:
            return cls(name)
        rows = name[len("verify"):]
        if name.startswith("verify") and rows.isdigit() and int(rows) > 1:
            return cls("decode", int(rows))
        raise ValueError(f"step {name!r}: expected prefill, decode, or verifyR with R >= 2 rows (verify4)")

    @property
    def snapshots(self) -> bool:
        """Verification steps (rows > 1) write per-row KDA snapshots."""
        return self.rows > 1

    @property
    def name(self) -> str:
        if self.mode == "prefill":
            return "prefill"
        return "decode" if self.rows == 1 else f"verify{self.rows}"


@dataclass
class GraphInput:
    name: str                              # "meta.slot_mapping", or a weight's module path
    is_weight: bool
    tensor: Optional[torch.Tensor] = None  # weights: the model's own tensor (live)


@dataclass
class Captured:
    gm: Optional[torch.fx.GraphModule]     # None for a program loaded from the compile cache
    step: StepKind
    inputs: list[GraphInput]               # one per placeholder, in order
    in_spec: pytree.TreeSpec               # structure of (input_ids, meta, caches)
    dims: dict[str, str] = field(default_factory=dict)   # sympy symbol name -> "B" / "T"
    seconds: float = 0.0
    leaf_checks: Optional[list] = None     # flat_step_inputs' compiled shape checks (built on first use)
    _weights: Optional[list] = None
    passed_leaves: dict = field(default_factory=dict)   # leaf index -> last fixed-size tensor checked

    @property
    def weights(self) -> list[torch.Tensor]:
        """The weight inputs, in order (the model's live tensors; listed once, read every step)."""
        if self._weights is None:
            self._weights = [i.tensor for i in self.inputs if i.is_weight]
        return self._weights


def check_model(model) -> K31ForCausalLM:
    if not isinstance(model, K31ForCausalLM):
        raise ValueError(f"model: k31c compiles the K3.1 architecture (K31ForCausalLM); got "
                         f"{type(model).__module__}.{type(model).__qualname__}")
    return model


# ---- names ---------------------------------------------------------------------------------------

def canonical_path(path: str) -> str:
    """A module path as k31c prints it, from either export's or Dynamo's spelling.

    `step.model.layers.3.self_attn` and `L['self'].model.layers[3].self_attn` both become
    `layers.3.self_attn` (the `model.` of K31ForCausalLM is dropped: every path has it)."""
    p = re.sub(r"^L\[['\"]self['\"]\]", "", path)
    p = re.sub(r"^L\[['\"](\w+)['\"]\]", r"\1", p)
    p = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", p)
    p = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", p)
    p = p.strip(".")
    for prefix in ("step.", "model."):
        if p.startswith(prefix):
            p = p[len(prefix):]
    return p


def module_path(node: torch.fx.Node) -> str:
    """The innermost module a node was traced in ("" at the top level)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return canonical_path(path)


def module_classes(node: torch.fx.Node) -> list[str]:
    """Class names of the modules a node was traced in, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for _, cls in stack.values():
        name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append(name.rsplit(".", 1)[-1])
    return out


def _input_name(keypath, arg_names: Sequence[str]) -> str:
    parts = []
    for k in keypath:
        if isinstance(k, pytree.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, pytree.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, pytree.MappingKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    head = arg_names[int(parts[0])] if parts[0].isdigit() and int(parts[0]) < len(arg_names) else parts[0]
    return ".".join([head] + parts[1:])


# ---- example inputs --------------------------------------------------------------------------

def example_sizes(step: StepKind, static: set) -> tuple[int, int]:
    """(B, rows) of the synthetic example: the smallest B >= 2 (prefill rows T >= 6) whose symbolic
    sizes (B, B + 1 and the rows: B x R, or T) are neither 0 or 1 (torch would specialize them),
    nor equal to each other or to any static size of the step's inputs. A symbolic size equal to
    a static one at the example may be taken for the same size by a compiler that sizes by the
    example's values (torch 2.11's standalone_compile did: a verify4 piece took the block table's
    width, 8, for its rows, B x R = 8 at B = 2)."""
    for b in range(2, 4096):
        for n in (range(6, 4096) if step.mode == "prefill" else (b * step.rows,)):
            if step.mode == "prefill" and n in (b, b + 1):       # T is a symbol of its own
                continue
            if not {b, b + 1, n} & static:
                return b, n
    raise ValueError(f"capture: no example size avoids the static sizes {sorted(static)[:16]}")


def static_sizes(model: torch.nn.Module, step: StepKind, meta: StepMeta, caches: Caches) -> set:
    """Every dimension size of the weights and the cache planes (a snapshot's are a plane's and
    R), the block table's width and R."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for t in pytree.tree_leaves((caches.mla, caches.kda)) if isinstance(t, torch.Tensor)]
    return {int(d) for t in tensors for d in t.shape} | {int(meta.block_table.shape[1]), step.rows}


def example_step(step: StepKind, meta: StepMeta, caches: Caches, sizes: tuple[int, int]):
    """Synthetic inputs of the step's kind: `sizes` = (B requests, rows) (`example_sizes`), the
    block table width and every cache taken from the real ones. Values do not matter (the trace
    runs on fake tensors)."""
    dev = meta.slot_mapping.device
    B, n = sizes
    ex_meta = step_meta(slot_mapping=torch.arange(n, device=dev),
                        block_table=torch.zeros(B, meta.block_table.shape[1], device=dev),
                        row_req=torch.zeros(n, device=dev), row_len=torch.ones(n, device=dev),
                        kda_slots=torch.arange(B, device=dev), cu_seqlens=torch.arange(B + 1, device=dev))
    snaps = None
    if step.snapshots:
        snaps = [KDASnapshots(torch.empty(B, step.rows, *st.conv.shape[1:], dtype=st.conv.dtype, device=dev),
                              torch.empty(B, step.rows, *st.recurrent.shape[1:], dtype=st.recurrent.dtype,
                                          device=dev))
                 for st in caches.kda]
    ex_caches = Caches(list(caches.mla), list(caches.kda), snaps)
    return torch.zeros(n, dtype=torch.int64, device=dev), ex_meta, ex_caches


def _dynamic_shapes(step: StepKind, caches: Caches):
    batch = Dim("B", min=1)
    rows = Dim("T", min=1) if step.mode == "prefill" else (batch * step.rows if step.rows > 1 else batch)
    meta = [{0: rows}, {0: batch}, {0: rows}, {0: rows}, {0: batch}, {0: batch + 1}]
    cache_spec = [[[None, None] for _ in caches.mla], [[None, None] for _ in caches.kda]]
    if step.snapshots:
        cache_spec.append([[{0: batch}, {0: batch}] for _ in caches.kda])
    return ({0: rows}, meta, cache_spec)


class _Step(torch.nn.Module):
    """The model with the step kind baked in, so export sees (input_ids, meta, caches) only."""

    def __init__(self, model: K31ForCausalLM, step: StepKind):
        super().__init__()
        self.step = model
        self.kind = step

    def forward(self, input_ids, meta, caches):
        return self.step(input_ids, meta, caches, self.kind.mode, self.kind.rows)


@contextlib.contextmanager
def _without_stack_traces():
    """No Python stack trace recorded on each node (`node.meta["stack_trace"]`): k31c names nodes
    by module path, and recording them took 2.1 of the 11.7 s that K3.1 Pro's 93-layer decode
    step took to trace (torch 2.13). torch >= 2.13 has a switch for it; before that, export's
    non-strict tracer (`_ModuleStackTracer`) turns recording on in its constructor, so its
    instances made inside this block have it turned off again."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is not None:
        config.do_not_emit_stack_traces = True
        try:
            yield
        finally:
            config.do_not_emit_stack_traces = before
        return
    from torch.fx.experimental import proxy_tensor
    tracer = getattr(proxy_tensor, "_ModuleStackTracer", None)
    if tracer is None:
        yield
        return
    init = tracer.__init__

    def init_without_traces(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.record_stack_traces = False
    tracer.__init__ = init_without_traces
    try:
        yield
    finally:
        tracer.__init__ = init


def trace(module: torch.nn.Module, args: tuple, dynamic_shapes, arg_names: Sequence[str],
          strip: str = "") -> tuple[torch.fx.GraphModule, list[GraphInput]]:
    """Export `module(*args)` non-strict into pre-dispatch aten and name the graph inputs: weights
    by their module path (without the wrapper attribute `strip`), step inputs by argument name and
    field path (`meta.slot_mapping`). The names go to `node.meta["k31c_input"]`."""
    with torch.no_grad(), _without_stack_traces():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    gm = ep.graph_module
    live = dict(module.named_parameters()) | dict(module.named_buffers())
    user = iter(_input_name(kp, arg_names) for kp, _ in pytree.tree_flatten_with_path(args)[0])
    inputs = []
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            tensor = live.get(spec.target)
            if tensor is None:
                tensor = ep.constants.get(spec.target, ep.state_dict.get(spec.target))
            path = spec.target
            if strip and path.startswith(strip + "."):
                path = path[len(strip) + 1:]
            inputs.append(GraphInput(canonical_path(path), True, tensor))
        elif kind == "USER_INPUT":
            inputs.append(GraphInput(next(user), False))
        else:
            raise ValueError(f"capture: unexpected graph input kind {kind} ({spec.arg})")
    for node, info in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs):
        node.meta["k31c_input"] = info.name
        node.meta["k31c_weight"] = info.is_weight
    return gm, inputs


def capture(model: K31ForCausalLM, step: StepKind, meta: StepMeta, caches: Caches) -> Captured:
    """Trace one step kind of `model` for the cache geometry of `caches` (shapes, not values)."""
    check_model(model)
    if step.snapshots and not caches.kda:
        raise ValueError("verification steps need KDA layers to snapshot")
    start = time.perf_counter()
    args = example_step(step, meta, caches, example_sizes(step, static_sizes(model, step, meta, caches)))
    gm, inputs = trace(_Step(model, step), args, _dynamic_shapes(step, caches),
                       ("input_ids", "meta", "caches"), strip="step")
    captured = Captured(gm, step, inputs, pytree.tree_structure(args), seconds=time.perf_counter() - start)
    captured.dims = _dim_names(captured, [n for n in gm.graph.nodes if n.op == "placeholder"])
    return captured


_CAPTURES: "weakref.WeakKeyDictionary[K31ForCausalLM, dict]" = weakref.WeakKeyDictionary()


def cache_geometry(meta: StepMeta, caches: Caches) -> tuple:
    """What a capture depends on besides the step kind: cache shapes/dtypes and the block table
    width (the snapshots' batch dimension is symbolic, so they do not count)."""
    planes = [t for c in caches.mla for t in (c.latent, c.index)] + \
             [t for s in caches.kda for t in (s.conv, s.recurrent)]
    return (meta.block_table.shape[1], meta.slot_mapping.device.type,
            tuple((tuple(t.shape), t.dtype) for t in planes))


def capture_cached(model: K31ForCausalLM, step: StepKind, meta: StepMeta, caches: Caches) -> Captured:
    """`capture`, reusing an earlier trace of the same model, step kind and cache geometry (the
    passes always work on a copy). The weights stay the model's live tensors."""
    check_model(model)
    per_model = _CAPTURES.setdefault(model, {})
    key = (step, cache_geometry(meta, caches))
    if key not in per_model:
        per_model[key] = capture(model, step, meta, caches)
    return per_model[key]


def _dim_names(captured: Captured, placeholders) -> dict[str, str]:
    """Name the free symbols by what they count: B requests, T prefill tokens."""
    names = {}
    wanted = {"meta.block_table": "B", "input_ids": "T" if captured.step.mode == "prefill" else None}
    for node, info in zip(placeholders, captured.inputs):
        label = wanted.get(info.name)
        val = node.meta.get("val")
        if label and isinstance(val, torch.Tensor) and isinstance(val.shape[0], torch.SymInt):
            expr = val.shape[0].node.expr
            if isinstance(expr, sympy.Symbol):
                names[str(expr)] = label
    return names


def clone_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose nodes can be rewritten without touching `gm` (metadata copied one level deep)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        if "k31c" in node.meta:
            new.meta["k31c"] = dict(node.meta["k31c"])
        env[node] = new
    graph._codegen = gm.graph._codegen
    return torch.fx.GraphModule(gm, graph)


def dynamo_to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Retrace a Dynamo graph (torch-level calls) into the same pre-dispatch aten IR that `capture`
    produces, keeping each node's module path, so the same passes apply (`backend="k31c"`)."""
    from torch._guards import TracingContext, detect_fake_mode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch._subclasses.fake_tensor import FakeTensor

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    context = TracingContext.try_get()
    fake_mode = (context.fake_mode if context else None) or detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise ValueError("dynamo_to_aten: no fake mode to trace with (call it from a Dynamo backend)")
    # Dynamo hands real inputs; its fake mode memoizes their fakes (with the symbolic sizes).
    vals = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in example_inputs]
    with fake_mode, torch.no_grad(), fx_traceback.preserve_node_meta():
        aten = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*vals)
    for old, new in zip(placeholders, [n for n in aten.graph.nodes if n.op == "placeholder"]):
        arg = old.meta.get("grapharg")
        source = getattr(arg, "source", None)
        source = (source.name() if callable(source.name) else source.name) if source is not None else old.name
        new.meta["k31c_input"] = canonical_path(source)
        new.meta["k31c_weight"] = "_parameters[" in source or "_buffers[" in source
    return aten
