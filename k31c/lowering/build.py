"""Build a Program from a partitioned graph: compile each distinct dense piece, bind each k31c op
to its registered kernel, turn stream markers into event steps (lowering/program.py).

Input: the top-level graph `passes/partition.py` produces (placeholders, `call_module` pieces and
their `getitem`s, k31c ops, markers, output) and each piece's key. The kernel of every k31c op is
looked up in the registry here, whatever the `lower` pass annotated, so what the report counts is
what the program calls. An op with no kernel for the target runs its reference implementation and
is counted as a fallback.

Dense pieces are compiled with the graph's fake inputs, so the batch stays symbolic and one
compiled piece serves every batch size: by Inductor's `compile_fx` (or, for the compile cache,
`standalone_compile`, saved as an artifact), by IREE (`dense_codegen="iree"`, lowering/iree.py:
the host's CPU, or gfx950 built and not run), or not at all (`"fx"`: each piece runs op by op;
quick to build, for tests and debugging). Equal pieces are compiled once.
"""
from __future__ import annotations

import operator
import time
from typing import Any, Callable, Optional

import torch

from ..errors import ArtifactError, CompilerError, KernelBindError, RuntimeFailure
from ..graph.ops import is_k31c
from ..graph.ops.streams import is_marker
from . import iree                              # imports IREE itself only when it builds
from .program import Dense, Kernel, Program, Record, Ref, Refs, Wait, arg_slots
from .registry import lookup
from .targets import Target

DENSE_CODEGENS = ("inductor", "fx", "iree")
K31C = torch.ops.k31c


def op_name(target) -> str:
    return f"k31c::{target._schema.name.split('::')[-1]}"


def bind(node: torch.fx.Node, target: Target) -> tuple[str, Callable]:
    """(kernel name, callable) for a k31c op node on `target`: the registered kernel (named by
    what runs the node's arguments), else the reference (on the CPU target the reference ops are
    the kernels)."""
    kernel = lookup(op_name(node.target), target.name) if target.device != "cpu" else None
    if kernel is not None:
        return kernel.name_for(example_args(node)), kernel.fn
    return "reference", node.target


def example_args(node: torch.fx.Node) -> list:
    """The node's arguments with graph values as their example (fake) tensors."""
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]


def compile_piece(gm: torch.fx.GraphModule, codegen: str, target: Target,
                  save: Optional[str] = None) -> Callable:
    """The piece as a callable: Inductor's code (with `target.pdl`, its kernels launched with
    programmatic dependent launch, as the k31c kernels are), IREE's module, or the FX module
    itself. With `save`, the build is also saved there (the compile cache): Inductor's as a
    standalone artifact, IREE's as its vmfb."""
    if codegen == "fx":
        return gm
    if codegen == "iree":
        return iree.compile_piece(gm, target, save)
    pdl = target.pdl
    example = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    try:
        with torch.no_grad(), inductor_config.patch({"triton.enable_pdl": True} if pdl else {}):
            if save is None:
                return compile_fx(gm, example)
            return save_artifact(gm, example, save)
    except (ArtifactError, RuntimeFailure):
        raise
    except Exception as e:                      # Inductor's errors carry the failing op
        raise no_compiler(e) or KernelBindError(
            f"build: Inductor failed on a dense piece ({len(gm.graph.nodes)} nodes): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def piece_file(index: int, codegen: str) -> str:
    """The file a compile-cache entry holds piece `index` in."""
    return f"{index}.vmfb" if codegen == "iree" else f"{index}.bin"


def no_compiler(e: Exception) -> Optional[RuntimeFailure]:
    """The machine's missing C++ compiler (Inductor's InvalidCxxCompiler, on its own or wrapped)
    as a RuntimeFailure saying so, else None: not a k31c bug, and no other build would work."""
    text = f"{type(e).__name__}: {e}"
    if "InvalidCxxCompiler" not in text:
        return None
    return RuntimeFailure("Inductor builds the dense code of CPU tensors as C++, and this machine has no "
                          f"working C++ compiler ({text.splitlines()[0]}); install one (g++) or set "
                          "$CXX, or run the eager model")


def save_artifact(gm: torch.fx.GraphModule, example: list, path: str) -> Callable:
    """`gm` compiled by Inductor as a standalone artifact (the batch symbolic: the shapes come
    from the graph), saved at `path` in Inductor's binary format; ArtifactError if it cannot be."""
    from torch._inductor import standalone_compile
    try:
        artifact = standalone_compile(gm, example, dynamic_shapes="from_graph")
        artifact.save(path=path, format="binary")
    except Exception as e:
        raise no_compiler(e) or ArtifactError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return artifact


def _args(node: torch.fx.Node, slots: dict[torch.fx.Node, int]) -> tuple:
    """The op's arguments in schema order, graph values as Ref(slot)."""
    schema = node.target._schema
    out = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            raise CompilerError(f"build: {node.name} has no value for argument '{arg.name}'")
        if isinstance(value, torch.fx.Node):
            value = Ref(slots[value])
        elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in value):
            if not all(isinstance(v, torch.fx.Node) for v in value):
                raise CompilerError(f"build: {node.name}: argument '{arg.name}' mixes graph values and "
                                    "constants in one list")
            value = Refs(tuple(slots[v] for v in value))
        out.append(value)
    return tuple(out)


def _n_outputs(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return len(val)
    return 0 if val is None else 1


def build_program(gm: torch.fx.GraphModule, piece_keys: dict[str, str], target: Target, name: str,
                  dense_codegen: str = "inductor", progress: Optional[Callable[[str], None]] = None,
                  save_pieces: Optional[str] = None) -> Program:
    """The Program of a partitioned graph (see the module docstring). With `save_pieces` (a
    directory), each compiled piece is also saved there (`piece_file`)."""
    if dense_codegen not in DENSE_CODEGENS:
        raise CompilerError(f"build: dense_codegen must be one of {DENSE_CODEGENS}, got {dense_codegen!r}")
    start = time.perf_counter()
    slots: dict[torch.fx.Node, int] = {}
    steps: list = []
    step_of: dict[torch.fx.Node, Any] = {}          # piece call / k31c op -> its step
    dense: list[tuple[Dense, str, str]] = []          # (step, piece key, submodule), compiled below
    outputs: tuple = ()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        slots[n] = i
    n_slots = len(placeholders)

    def new_slot(node):
        nonlocal n_slots
        slots[node] = n_slots
        n_slots += 1
        return slots[node]

    for node in gm.graph.nodes:
        stream = (node.meta.get("k31c") or {}).get("stream", 0)
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = tuple(slots[a] for a in node.args[0])
            continue
        if node.op == "call_module":
            step = Dense(-1, stream, tuple(slots[a] for a in node.args), tuple())
            step.outs = [None] * _n_outputs(node)
            steps.append(step)
            step_of[node] = step
            dense.append((step, piece_keys[node.target], node.target))
            continue
        if node.op != "call_function":
            raise CompilerError(f"build: unexpected {node.op} node {node.name} in a partitioned graph")
        if node.target is operator.getitem and node.args[0] in step_of:
            step_of[node.args[0]].outs[node.args[1]] = new_slot(node)
            continue
        if is_marker(node.target):
            if node.target is K31C.event_record.default:
                steps.append(Record(node.args[0], node.args[1]))
            elif node.target is K31C.event_wait.default:
                steps.append(Wait(node.args[0], node.args[1]))
            continue                                  # region enter/exit: structure only
        if not is_k31c(node):
            raise CompilerError(f"build: {node.name} ({node.target}) is neither in a dense piece nor a "
                                "k31c op; partition should have placed it")
        kernel, fn = bind(node, target)
        n_out = _n_outputs(node)
        step = Kernel(op_name(node.target), kernel, fn, stream, _args(node, slots), tuple())
        if n_out == 1 and not isinstance(node.meta.get("val"), (tuple, list)):
            step.outs = (new_slot(node),)
        else:
            step.outs = [None] * n_out
            step_of[node] = step
        steps.append(step)
    for s in steps:
        if isinstance(s, (Dense, Kernel)):
            s.outs = tuple(s.outs)
    steps = main_stream_first(steps)
    weights = {slots[n] for n in placeholders if n.meta.get("k31c_weight")}
    for s in steps:
        if isinstance(s, Dense):
            s.weights_only = bool(s.args) and all(a in weights for a in s.args)
    pieces, piece_names = _compile_pieces(gm, dense, target, dense_codegen, name, progress, save_pieces)
    _assign_frees(steps, len(placeholders), outputs)
    names = [("@" if n.meta.get("k31c_weight") else "%") + n.meta.get("k31c_input", n.name) for n in placeholders]
    return Program(name, target.name, steps, pieces, piece_names, len(placeholders), n_slots, outputs,
                   dense_codegen, stats={"pieces": len(piece_keys), "compiled_pieces": len(pieces),
                                         "build_seconds": time.perf_counter() - start},
                   input_names=names)


def _compile_pieces(gm, dense: list, target: Target, codegen: str, name: str, progress,
                    save_dir: Optional[str]) -> tuple[list, list]:
    """Compile each distinct piece key once (with `target.pdl`, its kernels launched with PDL) and
    point every Dense step at its piece."""
    distinct = len({key for _, key, _ in dense})
    compiled: dict[str, int] = {}
    pieces: list[Callable] = []
    names: list[str] = []
    for step, key, module in dense:
        if key not in compiled:
            if progress is not None:
                progress(f"{name}: compiling dense piece {len(pieces) + 1}/{distinct}")
            compiled[key] = len(pieces)
            save = None if save_dir is None else f"{save_dir}/{piece_file(len(pieces), codegen)}"
            pieces.append(compile_piece(gm.get_submodule(module), codegen, target, save))
            names.append(key)
        step.piece = compiled[key]
    return pieces, names


def _reads(step) -> list[int]:
    if isinstance(step, Dense):
        return list(step.args)
    if isinstance(step, Kernel):
        return [slot for a in step.args for slot in arg_slots(a)]
    return []


def main_stream_first(steps: list) -> list:
    """Within each fork (a `Record` on stream 0 that side streams wait for), enqueue the main
    stream's work before the side branches', up to the main stream's first join `Wait`.

    Per-stream order is unchanged and every record still precedes its waits, so the program means
    the same; the main stream (the critical path: the query GEMMs) is launched first."""
    out, i = [], 0
    waited = {s.event for s in steps if isinstance(s, Wait) and s.stream != 0}
    while i < len(steps):
        s = steps[i]
        out.append(s)
        i += 1
        if not (isinstance(s, Record) and s.stream == 0 and s.event in waited):
            continue
        j = i
        while j < len(steps) and not (isinstance(steps[j], Wait) and steps[j].stream == 0):
            j += 1
        segment = steps[i:j]
        out += [t for t in segment if t.stream == 0] + [t for t in segment if t.stream != 0]
        i = j
    return out


def _assign_frees(steps: list, n_inputs: int, outputs: tuple) -> None:
    """Drop each intermediate value after its last reader, unless it crosses streams."""
    made_on: dict[int, int] = {}
    last: dict[int, int] = {}
    crosses: set[int] = set()
    for i, s in enumerate(steps):
        for slot in _reads(s):
            last[slot] = i
            if made_on.get(slot, s.stream) != s.stream:
                crosses.add(slot)
        for slot in getattr(s, "outs", ()):
            if slot is not None:
                made_on[slot] = s.stream
                last.setdefault(slot, i)
    keep = set(outputs) | crosses
    frees: dict[int, list[int]] = {}
    for slot, i in last.items():
        if slot >= n_inputs and slot not in keep:
            frees.setdefault(i, []).append(slot)
    for i, s in enumerate(steps):
        s.free = tuple(sorted(frees.get(i, ())))
