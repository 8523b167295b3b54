"""`k31c inspect`: the graph of one step after any pass, as canonical text or an SVG picture.

    k31c inspect --config tiny --step decode --after indexer_prolog
    k31c inspect --config tiny --step prefill --disable fuse_index_write,quantize
    k31c inspect --config tiny --step verify --rows 4 --target h200 --format svg --layer 3 -o g.svg
    k31c inspect --config tiny --step decode --target h200 --format program

The model is built from the config alone (weights are not needed to see the graph: they live on
the `meta` device, nothing is allocated), the cache pool is a fixed small geometry (4 requests,
256 tokens, blocks of 16), so the text is the same on every machine: it is what tests/golden holds.
"""
from __future__ import annotations

import json
from typing import Optional

from ..config import PRESETS, config_from_name_or_path
from ..errors import K31cError, UsageError
from .common import output_file, progress

STEPS = ("decode", "prefill", "verify")
POOL = dict(max_requests=4, max_seq_len=256, block_size=16)


def add(sub) -> None:
    p = sub.add_parser("inspect", help="print a step's graph after a pass (text or SVG)",
                       description="Capture one step of a K3.1 model, run the pass pipeline up to a "
                                   "pass, and print the graph in canonical text or draw it as SVG.")
    p.add_argument("--config", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}) or a config.json / checkpoint directory")
    p.add_argument("--step", choices=STEPS, default="decode")
    p.add_argument("--rows", type=int, default=None, help="rows per request of a verify step (default 2)")
    p.add_argument("--target", default="cpu", help="cpu, h200 or mi350x (default cpu)")
    p.add_argument("--after", default=None, help="stop after this pass (default: the whole pipeline)")
    p.add_argument("--passes", default=None, help="comma-separated pass list (default: all, in order)")
    p.add_argument("--disable", default=None, metavar="PASS[,PASS]",
                   help="run the pipeline without these passes")
    p.add_argument("--option", action="append", default=[], metavar="PASS.OPTION=VALUE",
                   help="a pass option, e.g. quantize.mxfp8_indexer=true (repeatable)")
    p.add_argument("--index-cache", choices=("bf16", "fp8", "mxfp8"), default=None,
                   help="index-key cache format of the pool (default: what the quantize options "
                        "ask for, as Engine(compiled) allocates it; else bf16)")
    p.add_argument("--format", choices=("text", "svg", "program"), default="text",
                   help="text: canonical graph; svg: a picture; program: the steps the GPU program "
                        "executor runs (dense pieces, bound kernels, events)")
    p.add_argument("--layer", type=int, default=None,
                   help="text, svg: only the ops of this decoder layer (0 is the first)")
    p.add_argument("--k31c-only", action="store_true",
                   help="text: only the k31c ops and stream markers (the per-target lowering)")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.set_defaults(run=run)


def parse_options(items: list[str]) -> dict:
    from ..passes.manager import registered
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not dot or not name or not option:
            raise UsageError(f"--option {item!r}: expected PASS.OPTION=VALUE")
        if name not in registered():    # compile options (buckets, executor) are not for inspect
            raise UsageError(f"--option {item!r}: expected PASS.OPTION=VALUE, and '{name}' is not a "
                             f"pass; passes: {', '.join(registered())}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name, {})[option] = value
    return out


def _names(text: Optional[str], flag: str) -> Optional[list[str]]:
    if text is None:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:      # an empty list would silently mean "no passes" or "the default"
        raise UsageError(f"{flag} {text!r} names no pass: give comma-separated pass names")
    return names


def pipeline(passes: Optional[list[str]], disable: Optional[list[str]]) -> Optional[list[str]]:
    """The pass list to run: `passes` (default: the default pipeline) minus `disable`."""
    from ..passes.manager import DEFAULT_PIPELINE
    if not disable:
        return passes
    base = list(passes or DEFAULT_PIPELINE)
    unknown = [d for d in disable if d not in base]
    if unknown:
        raise UsageError(f"--disable: {', '.join(repr(u) for u in unknown)} not in the pipeline "
                         f"({', '.join(base)})")
    return [p for p in base if p not in disable]


def step_kind(step: str, rows: int):
    from ..graph.capture import StepKind
    if step == "verify":
        if rows < 2:
            raise UsageError(f"--rows must be at least 2 for a verify step, got {rows}")
        return StepKind("decode", rows)
    return StepKind(step)


def shape_model(cfg):
    """The model with its weights on the meta device: shapes and dtypes only."""
    import torch

    from ..graph.model import K31ForCausalLM
    with torch.device("meta"):
        return K31ForCausalLM(cfg).eval()


def pool_inputs(cfg, index_cache: str = "bf16", device="meta", latent_cache: str = "model"):
    """Step metadata and caches of the fixed inspection pool (values are never read)."""
    from ..graph.step import step_meta
    from ..runtime.kv import CachePool
    try:
        pool = CachePool(cfg, index_cache=index_cache, latent_cache=latent_cache, device=device, **POOL)
    except ValueError as e:     # a cache format this config cannot have
        if isinstance(e, K31cError):
            raise
        raise UsageError(f"the inspection pool: {e}") from None
    meta = step_meta(slot_mapping=[0], block_table=pool.block_table[:1], row_req=[0], row_len=[1],
                     kda_slots=[0], cu_seqlens=[0, 1], device=device)
    return meta, pool.caches()


def _compile(model, target, passes, options):
    """k31c.compile, whose plain ValueErrors here are about the names the user gave (a pass,
    an option, a target): usage errors."""
    from ..api import compile as k31c_compile
    try:
        return k31c_compile(model, target=target, passes=passes, options=options)
    except ValueError as e:
        if isinstance(e, K31cError):
            raise
        raise UsageError(str(e)) from None


def inspect_graph(cfg, step: str = "decode", rows: int = 2, target: str = "cpu", passes=None,
                  options: Optional[dict] = None, after: Optional[str] = None,
                  index_cache: Optional[str] = None, model=None):
    """Build one step's graph without running it. Returns (graph module, captured). Passing the
    same `model` (a `shape_model(cfg)`) again reuses its capture. index_cache: the pool's index
    keys; None: the compile's quantize options' (`cache_formats`), else bf16."""
    kind = step_kind(step, rows)
    compiled = _compile(model if model is not None else shape_model(cfg), target, passes, options)
    if after is not None and after not in compiled.pipeline.names:
        from ..passes.manager import registered
        known = "unknown pass" if after not in registered() else "pass"
        raise UsageError(f"--after: {known} '{after}' is not in the pipeline "
                         f"({', '.join(compiled.pipeline.names)})")
    # the cache formats the quantize options ask for, as Engine(compiled) allocates them (a bad
    # value is left to the quantize pass, whose error names its option)
    from ..runtime.kv import INDEX_CACHE_KINDS, LATENT_CACHE_KINDS
    latent = compiled.cache_formats.get("latent_cache", "model")
    latent = latent if latent in LATENT_CACHE_KINDS else "model"
    if index_cache is None:
        index_cache = compiled.cache_formats.get("index_cache", "bf16")
        index_cache = index_cache if index_cache in INDEX_CACHE_KINDS else "bf16"
    meta, caches = pool_inputs(cfg, index_cache, latent_cache=latent)
    progress(f"capturing the {step} step and running the passes")
    program = compiled.build(kind, meta, caches, stop_after=after, executable=False)
    return program.gm, program.captured


def program_text(gm, target: str, step: str) -> str:
    """The program the executor would run for this graph: partitioned, kernels bound (the dense
    pieces are listed, not compiled)."""
    from ..graph.capture import clone_graph
    from ..lowering.build import build_program
    from ..lowering.targets import get_target
    from ..passes.partition import partition
    split = partition(clone_graph(gm))
    program = build_program(split.gm, {n: p.key for n, p in split.pieces.items()}, get_target(target),
                            step, dense_codegen="fx")
    return program.describe() + "\n"


def render(gm, captured, fmt: str, title: str, layer: Optional[int] = None,
           k31c_only: bool = False, target: str = "cpu") -> str:
    if fmt == "program":
        return program_text(gm, target, captured.step.name)
    if layer is not None and not any((n.meta.get("k31c") or {}).get("layer") == layer
                                     for n in gm.graph.nodes):
        raise UsageError(f"--layer {layer}: no op of this graph is in layer {layer} (layers are "
                         "set by the annotate_layers pass)")
    if fmt == "svg":
        from ..graph.svg import draw_svg
        return draw_svg(gm, title=title, layer=layer)
    from ..graph.printer import format_graph
    return format_graph(gm, title=title, dims=captured.dims, only_k31c=k31c_only, layer=layer)


def check_args(args, cfg) -> None:
    """Flags that would be ignored are refused, before anything is built."""
    if args.rows is not None and args.step != "verify":
        raise UsageError(f"--rows applies to --step verify only, not --step {args.step}")
    if args.layer is not None:
        if args.format == "program":
            raise UsageError("--layer applies to --format text or svg, not --format program")
        n = cfg.num_hidden_layers
        if not 0 <= args.layer < n:
            raise UsageError(f"--layer {args.layer}: the model has {n} decoder layers, 0 to {n - 1}")
    if args.k31c_only and args.format != "text":
        raise UsageError(f"--k31c-only applies to --format text only, not --format {args.format}")
    if args.format == "program" and args.after is not None:
        raise UsageError("--format program shows the program of the whole pipeline; drop --after")


def run(args) -> int:
    output = output_file(args.output, "-o") if args.output else None
    cfg = config_from_name_or_path(args.config)
    check_args(args, cfg)
    rows = 2 if args.rows is None else args.rows
    step_kind(args.step, rows)
    progress("loading torch and the passes")
    from ..passes.manager import DEFAULT_PIPELINE
    passes = pipeline(_names(args.passes, "--passes"), _names(args.disable, "--disable"))
    progress(f"building the {args.config} model on the meta device")
    gm, captured = inspect_graph(cfg, args.step, rows, args.target, passes,
                                 parse_options(args.option), args.after, args.index_cache)
    ran = DEFAULT_PIPELINE if passes is None else passes     # --passes X --disable X: none
    after = args.after or (ran[-1] if ran else "capture (no passes)")
    title = f"{captured.step.name} target={args.target} after={after}"
    text = render(gm, captured, args.format, title, args.layer, args.k31c_only, args.target)
    if output is not None:
        from ..fsutil import write_atomic
        write_atomic(output, lambda f: f.write(text.encode()))
    else:
        print(text, end="")
    return 0
