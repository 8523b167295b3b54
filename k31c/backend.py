"""Whole-graph executors and `torch.compile(module, backend="k31c")`: the k31c passes on
Dynamo's graph, run by executor "inductor" or "fx" (k31c.compile builds the programs; api.py).
Importing this module registers the backend name "k31c" with Dynamo."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .errors import UsageError
from .graph.capture import clone_graph
from .lowering.build import no_compiler
from .lowering.targets import Target, get_target
from .options import split_options
from .passes.manager import PassContext, resolve, run_pipeline


def make_executor(gm: torch.fx.GraphModule, example_inputs: list, executor: str, target: Target):
    """A callable running `gm` (not modified) on real inputs (the whole-graph executors)."""
    if executor == "fx":
        return clone_graph(gm)
    from torch._inductor.compile_fx import compile_fx
    try:
        with torch.no_grad():
            return compile_fx(clone_graph(gm), example_inputs)
    except Exception as e:
        failure = no_compiler(e)
        if failure is None:
            raise
        raise failure from e



# ---- torch.compile(backend="k31c") ---------------------------------------------------------------

BACKEND_COMPILES: list[dict] = []      # one entry per graph the Dynamo backend compiled


def backend(target: str = "cpu", passes=None, options: Optional[dict] = None):
    """A Dynamo backend running the k31c passes: `torch.compile(m, backend=k31c.backend.backend(...))`."""
    from .graph.capture import dynamo_to_aten
    t = get_target(target)
    compile_opts, pass_opts = split_options(options, t)
    if compile_opts["executor"] == "program":
        raise UsageError("the Dynamo backend runs whole graphs (executor inductor or fx); "
                         "k31c.compile builds programs")
    pipeline = resolve(passes, pass_opts)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        aten = dynamo_to_aten(gm, example_inputs)
        ctx = PassContext(target=t, step=f"dynamo{len(BACKEND_COMPILES)}")
        records = run_pipeline(aten, pipeline, ctx)
        fn = make_executor(aten, list(example_inputs), compile_opts["executor"], t)
        BACKEND_COMPILES.append({"step": ctx.step, "nodes": len(aten.graph.nodes), "passes": records,
                                 "seconds": time.perf_counter() - start})

        def run(*args):
            with torch.no_grad():
                return fn(*args)
        return run
    return compile_graph


dynamo_backend = backend()     # the default one, "k31c" (k31c.dynamo_backend calls it)


def _register_backend() -> None:
    import torch._dynamo.backends.registry  # noqa: F401  (loaded, so the name can be registered)
    from .dynamo_registry import register
    register(dynamo_backend)


_register_backend()
