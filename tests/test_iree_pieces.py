"""IREE as the dense code generator (lowering/iree.py): the program's dense pieces as IREE
modules, run on the CPU (llvm-cpu) against eager, stored in and loaded from the compile cache,
and built for gfx950 (mi350x: compile-only)."""
import pytest
import torch

pytest.importorskip("iree.compiler")
pytest.importorskip("iree.runtime")

import k31c.api as k31c_api                       # noqa: E402
from k31c.compile_cache import CompileCache       # noqa: E402
from k31c.errors import UsageError                # noqa: E402
from k31c.graph.capture import StepKind           # noqa: E402
from k31c.lowering import iree                    # noqa: E402
from tiny_model import close, engine_scenario, make_model  # noqa: E402

def _piece(fn, *examples) -> torch.fx.GraphModule:
    """`fn` as a dense piece is built: an FX graph whose nodes carry fake values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    gm = torch.fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(e) for e in examples])
    return gm


IREE_CPU = {"executor": "program", "dense_codegen": "iree"}
SCENARIO = ([(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2)    # prefill, decode, verification rows


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The tiny model's prefill, decode and verification programs built with IREE pieces, into a
    fresh compile cache, and the logits of one engine run through them."""
    root = tmp_path_factory.mktemp("iree-cache")
    model = make_model()
    compiled = k31c_api.compile(model, target="cpu", options={**IREE_CPU, "cache": root})
    return model, root, compiled, engine_scenario(model, compiled, *SCENARIO)


def test_iree_pieces_compute_what_eager_computes(cold):
    model, _, compiled, got = cold
    # measured: 3.0e-4 at the worst logit row, and 6.4e-4 on an AMD EPYC host with AVX-512
    # (2026-12-06): IREE's llvm-cpu code follows the host's vector ISA (Inductor's C++ on the same
    # run: 6.3e-5; each piece alone agrees with eager to < 1e-5 on random inputs: IREE's fp32
    # math differs a little, and 40-token prompts through the indexer and KDA grow it)
    close(got, engine_scenario(model, model, *SCENARIO), tol=1e-3)
    decode = compiled.programs["decode"]
    assert decode.dense_codegen == "iree" and decode.pieces
    assert all(isinstance(p, iree.IreePiece) and p.arch == "host" for p in decode.pieces)
    assert all(p.calls > 0 for p in decode.pieces)          # every module ran, none skipped
    assert "compiled, iree)" in compiled.report.steps["decode"].program


def test_iree_programs_load_from_the_compile_cache_without_compiling(cold, monkeypatch):
    model, root, _, got = cold
    entries = {path.name.split("-")[0]: entry for path, entry, _ in CompileCache(root).entries()}
    assert set(entries) == {"prefill", "decode", "verify3"}
    pieces = entries["decode"].manifest["info"]["program"]["piece_names"]
    assert all(f"pieces/{i}.vmfb" in entries["decode"].manifest["files"] for i in range(len(pieces)))
    assert entries["decode"].manifest["factors"]["machine"].startswith("IREE ")

    monkeypatch.setattr(iree, "compile_piece", lambda *a, **k: pytest.fail("the warm start compiled"))
    monkeypatch.setattr(k31c_api, "capture_cached", lambda *a, **k: pytest.fail("the warm start captured"))
    warm = k31c_api.compile(model, target="cpu", options={**IREE_CPU, "cache": root})
    again = engine_scenario(model, warm, *SCENARIO)
    assert all(r.cache.startswith("hit ") for r in warm.report.steps.values())
    assert torch.equal(again, got)                           # the same modules: the same bits


def test_mi350x_builds_its_dense_pieces_for_gfx950_and_does_not_run_them():
    from k31c.cli.inspect import pool_inputs
    model = make_model()
    compiled = k31c_api.compile(model, target="mi350x", options={"cache": False})
    assert compiled.options["dense_codegen"] == "iree"      # the target record's default
    meta, caches = pool_inputs(model.config, device="cpu")     # where the weights are
    program = compiled.build(StepKind("decode"), meta, caches)
    pieces = program.kernels.pieces
    assert pieces and all(p.arch == "gfx950" for p in pieces)
    # the modules' code objects are AMDGPU ELFs (OS ABI HSA, machine 0xe0), none for another
    # machine (a piece of views alone dispatches nothing and holds none)
    import re
    elves = [p.vmfb[m.start():m.start() + 20] for p in pieces for m in re.finditer(b"\x7fELF", p.vmfb)]
    assert len(elves) >= len(pieces) // 2
    assert all(e[7] == 0x40 and int.from_bytes(e[18:20], "little") == 0xE0 for e in elves)
    assert "built for mi350x, not run here" in compiled.report.steps["decode"].program
    with pytest.raises(UsageError, match="compile-only here"):
        compiled(torch.zeros(2, dtype=torch.long), meta, caches, mode="decode")


@pytest.mark.parametrize("target, options, message", [
    ("h200", IREE_CPU, "IREE has no code generation for target 'h200'"),
    ("cpu", {"dense_codegen": "iree"}, "compiles the dense pieces of executor 'program'"),
    ("cpu", {"executor": "program", "dense_codegen": "tvm"}, "option dense_codegen must be one of"),
])
def test_bad_iree_options_are_errors_naming_them(target, options, message):
    with pytest.raises(UsageError, match=message):
        k31c_api.compile(make_model(), target=target, options=options)


def test_a_piece_iree_cannot_compile_is_an_error_naming_it():
    from k31c.errors import KernelBindError
    from k31c.lowering.targets import get_target
    aten = torch.ops.aten          # an FFT: IREE's torch input has no lowering for it
    gm = _piece(lambda x: (aten.view_as_real.default(aten._fft_r2c.default(x, [0], 0, True)),), torch.randn(8))
    with pytest.raises(KernelBindError, match=r"IREE failed on a dense piece \(\d+ nodes\) for host"):
        iree.compile_piece(gm, get_target("cpu"))


def test_a_bf16_piece_runs_through_numpy_and_back():
    """bf16 tensors cross into IREE as their bits (numpy has no bfloat16) and come back as bf16."""
    from k31c.lowering.targets import get_target

    def piece(x, w):                                     # aten ops, as an exported piece has
        return (torch.ops.aten.silu.default(torch.ops.aten.mm.default(x, torch.ops.aten.t.default(w))),)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    gm = _piece(piece, x, w)
    [got] = iree.compile_piece(gm, get_target("cpu"))(x, w.requires_grad_())
    want = piece(x.double(), w.detach().double())[0]      # the oracle: float64
    assert got.dtype == torch.bfloat16 and got.shape == (5, 32)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2   # bf16 rounding: 2^-8


def test_the_cli_flag_asks_for_the_program_executor():
    from k31c.cli.common import compile_model
    compiled = compile_model(make_model(), "cpu", None, "iree")
    assert (compiled.executor, compiled.options["dense_codegen"]) == ("program", "iree")
    assert compile_model(make_model(), "cpu", None).executor == "inductor"
