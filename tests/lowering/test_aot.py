"""Ahead-of-time build of the Triton kernels for gfx950 (mi350x) and sm_90a (h200), no GPU needed.

The builds run in a subprocess without TRITON_INTERPRET (conftest turns the interpreter on for
this process, and interpreted kernels cannot be compiled). They share the repository's Triton
cache, so a rerun is fast; a cold build takes ~25 s for the default tests and ~60 s more for the
h200 build of the slow families (indexer, mla_dense_ws, topk: marked `slow`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k31c.lowering.registry import kernels_for

ROOT = Path(__file__).resolve().parents[2]

# Ops registered for h200 but not for mi350x (a kernel that does not compile for gfx950), with
# the reason. Empty since dot precision is chosen per backend and top-k's histogram clear uses
# atomic_and; the list may only grow together with a registration and a comment at the kernel.
GFX950_UNSUPPORTED: dict[str, str] = {}
SLOW_H200_FAMILIES = ("indexer", "mla_dense_ws", "topk", "indexer_topk")

EM_AMDGPU, ELFOSABI_AMDGPU_HSA, EF_AMDGPU_MACH_GFX950 = 224, 64, 0x04F
EM_CUDA, EF_CUDA_ARCH_SPECIFIC = 190, 0x800    # 'a' targets: e_flags 0x5a0d5a (sm_90: 0x5a055a)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _start_build(target: str, out: Path, families=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k31c", "build-kernels", "--target", target,
           "--out", str(out)]
    if families:
        cmd += ["--only", ",".join(families)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, out: Path) -> tuple[str, dict]:
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"build failed:\n{stdout}\n{stderr}"
    return stdout, json.loads((out / "manifest.json").read_text())


def _registered(target: str, families) -> dict[str, str]:
    """op -> family of the Triton kernels registered for the target (in those families)."""
    ops = {op: k.source.rsplit(".", 1)[-1] for op, k in kernels_for(target).items()
           if k.backend == "triton"}
    return {op: fam for op, fam in ops.items() if families is None or fam in families}


def _elf(data: bytes) -> tuple[int, int, int]:
    """(OS ABI, e_machine, e_flags) of a 64-bit little-endian ELF file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit LE ELF file"
    return data[7], int.from_bytes(data[18:20], "little"), int.from_bytes(data[48:52], "little")


def _check_build(target: str, families, stdout: str, manifest: dict, out: Path) -> None:
    kernels = manifest["kernels"]
    assert manifest["target"] == target and kernels
    # every registered op of these families has its kernels built, and nothing else was built
    want = _registered(target, families)
    built_ops = {op for k in kernels for op in k["ops"]}
    assert set(want) <= built_ops, f"ops without a built kernel: {sorted(set(want) - built_ops)}"
    assert built_ops <= set(_registered(target, None))
    # a build shared by two families (the indexer + top-k pair reuses both families' kernels)
    # is named after the first family listing it; every family still has its builds
    family_of = _registered(target, None)
    assert {family_of[op] for k in kernels for op in k["ops"] if op in want} == set(want.values())
    for k in kernels:
        assert k["name"].split("/")[0] in {family_of[op] for op in k["ops"]}, k["name"]
    # one progress line per kernel, then the summary
    lines = stdout.strip().splitlines()
    assert len(lines) == len(kernels) + 1 and lines[-1].startswith(f"{len(kernels)} kernels for {target}")
    for k, line in zip(kernels, lines):
        assert line.startswith(k["name"]) and k["arch"] in line and f"{k['size']} B" in line
    for k in kernels:
        data = (out / k["file"]).read_bytes()
        assert len(data) == k["size"] > 0 and hashlib.sha256(data).hexdigest() == k["sha256"]
        # 12: a warp-specialized kernel's three partitions (producer, two math groups) in
        # 4-warp groups (mla_dense_ws's 1-warp producer's group padded)
        assert k["num_warps"] in (1, 2, 4, 8, 12, 16) and k["shared"] >= 0 and k["n_regs"] > 0
        osabi, machine, flags = _elf(data)
        if target == "mi350x":
            assert k["binary_kind"] == "hsaco" and k["file"].endswith(".hsaco")
            assert (osabi, machine) == (ELFOSABI_AMDGPU_HSA, EM_AMDGPU), k["name"]
            assert flags & 0xFF == EF_AMDGPU_MACH_GFX950, f"{k['name']}: e_flags {flags:#x}"
            assert k["asm_target"] == "amdgcn-amd-amdhsa--gfx950"
        else:
            assert k["binary_kind"] == "cubin" and k["file"].endswith(".cubin")
            assert machine == EM_CUDA, k["name"]
            assert flags & 0xFF == 90 and flags & EF_CUDA_ARCH_SPECIFIC, f"{k['name']}: e_flags {flags:#x}"
            assert k["asm_target"] == "sm_90a"                         # the PTX's .target line


@pytest.fixture(scope="module")
def default_builds(tmp_path_factory):
    """mi350x (every family registered for it) and h200's fast families, built side by side."""
    h200_fast = sorted(set(_registered("h200", None).values()) - set(SLOW_H200_FAMILIES))
    jobs = {"mi350x": None, "h200": h200_fast}
    outs = {t: tmp_path_factory.mktemp(f"aot-{t}") for t in jobs}
    procs = {t: _start_build(t, outs[t], fams) for t, fams in jobs.items()}
    return {t: (jobs[t], *_finish(procs[t], outs[t]), outs[t]) for t in jobs}


def test_gfx950_restrictions_are_exactly_the_known_ones():
    h200, mi350x = set(kernels_for("h200")), set(kernels_for("mi350x"))
    assert mi350x <= h200
    assert h200 - mi350x == set(GFX950_UNSUPPORTED)


@pytest.mark.parametrize("target", ["mi350x", "h200"])
def test_build_default(default_builds, target):
    families, stdout, manifest, out = default_builds[target]
    _check_build(target, families, stdout, manifest, out)
    if target == "mi350x":   # every op registered for mi350x has its kernels built
        assert {op for k in manifest["kernels"] for op in k["ops"]} == set(_registered("mi350x", None))
    else:   # built as the JIT specializes the launches' integers: software-pipelined, no spill
        # (the half-release seesaw: at most 24 B of stack, see the slow families' test)
        for name in ("linear_group/_linear_group_kernel[", "mla_sparse_ws/sparse_half_kernel[half,",
                     "mla_sparse_ws/_sparse_ws_kernel[fp8,", "moe_experts/_gate_up_kernel["):
            k = next(k for k in manifest["kernels"] if k["name"].startswith(name))
            assert (k["scratch_bytes"] or 0) <= (24 if "half" in name else 0), k
            assert k["shared"] > 48 << 10, k


@pytest.mark.slow
def test_build_h200_slow_families(tmp_path):
    stdout, manifest = _finish(_start_build("h200", tmp_path, SLOW_H200_FAMILIES), tmp_path)
    _check_build("h200", SLOW_H200_FAMILIES, stdout, manifest, tmp_path)


def test_cli_hook_and_errors(capsys):
    from k31c.cli.build_kernels import add
    from k31c.lowering.aot import collect_specs
    parser = argparse.ArgumentParser()
    add(parser.add_subparsers())
    args = parser.parse_args(["build-kernels", "--target", "nope", "--out", "d", "--only", "topk"])
    assert (args.target, args.out, args.only) == ("nope", "d", "topk")
    assert args.run(args) == 2 and "unknown target 'nope'" in capsys.readouterr().err
    args = parser.parse_args(["build-kernels", "--target", "cpu"])
    assert args.run(args) == 2 and "no Triton backend" in capsys.readouterr().err
    if os.environ.get("TRITON_INTERPRET") == "1":     # this process: kernels are interpreted
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            collect_specs("mi350x")


_INTS_PROBE = """
import torch
import triton
from k31c.lowering import aot
from k31c.lowering.aot_spec import kernel_spec
from k31c.lowering.triton import linear_group as lg
ptrs = {"x_ptr": torch.bfloat16, **{f"w{i}_ptr": torch.bfloat16 for i in range(8)},
        **{f"y{i}_ptr": torch.bfloat16 for i in range(8)}}
consts = dict(S1=1, S2=2, S3=3, S4=4, S5=5, S6=6, S7=7, NSEG=8, BM=16, BN=64, BK=128, PRECISION="tf32",
              UPCAST=False)
spec = kernel_spec(lg._linear_group_kernel, "k31c::linear_group", "t", consts, ptrs,
                   ints=dict(M=1, K=7168, stride_xm=100))
assert spec.signature["M"] == "constexpr" and spec.constexprs["M"] == 1, spec.signature
assert spec.divisible == ("K",) and spec.signature["K"] == "i32", spec.divisible
# the same rule as this Triton's JIT
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
for v in (0, 1, 7, 16, 100, 7168):
    jit = native_specialize_impl(BaseBackend, v, False, True, True)
    s = kernel_spec(lg._linear_group_kernel, "k31c::linear_group", "t", consts, ptrs, ints=dict(K=v))
    mine = ("constexpr", 1) if s.signature["K"] == "constexpr" else ("i32", "D" if s.divisible else "")
    assert mine == tuple(jit), (v, mine, jit)
for bad in (dict(BM=16), dict(nope=3), dict(x_ptr=16)):
    try:
        kernel_spec(lg._linear_group_kernel, "k31c::linear_group", "t", consts, ptrs, ints=bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError as e:
        assert "ints" in str(e), e
from k31c.lowering.triton import indexer as tix
for target in ("h200", "mi350x"):
    for spec in aot.collect_specs(target):
        listed = dict(spec.ints)
        missing = [n for n, t in spec.signature.items() if t in ("i32", "i64") and n not in listed]
        ones = [n for n, v in listed.items() if v == 1 and spec.signature[n] != "constexpr"]
        if missing or ones:
            print(target, aot.spec_name(spec), missing, ones)
# h200 builds the KDA decode pair of one row a request both plain and as a PDL pair (the state
# pass the prep's dependent, PDL whatever the target's `pdl`); its 4-row pass and mi350x plain only
for target in ("h200", "mi350x"):
    got = set()
    for s in aot.collect_specs(target, families=["kda_decode"]):
        c = s.constexprs
        if s.kernel.__name__ == "kda_decode_state_kernel":
            assert c.get("STATE_FIRST", False) == bool(c["PDL"]), (target, s.variant)
            got.add(("state", c["ROWS"], c.get("STATE_FIRST", False)))
        elif s.kernel.__name__ == "kda_decode_prep_kernel":
            got.add(("prep", c["ROWS"], c.get("DEPENDENT", False)))
    pairs = {(k, 1, True) for k in ("state", "prep")} if target == "h200" else set()
    assert got == {(k, r, False) for k in ("state", "prep") for r in (1, 4)} | pairs, (target, got)
# the KDA prefill kernels are built at the target's chunk size (h200: 16 rows), else the model's;
# h200's state pass splits V (launch_defaults), so its norm launch is built too
for target, chunk, norm in (("h200", 16, True), ("mi350x", 64, False)):
    specs = aot.collect_specs(target, families=["kda_prefill"])
    assert {s.constexprs["C"] for s in specs if "C" in s.constexprs} == {chunk}
    assert any(s.kernel.__name__ == "_gated_norm_kernel" for s in specs) == norm, target
# the registered MXFP8 scan (the TMA kernel's MX form) builds for sm_90a at R = 1 without
# spilling (~127 registers)
shapes = aot.default_shapes("h200")
for spec in tix.mx_aot_specs(shapes, "tma")[:1]:
    ck = aot.compile_spec(spec, "h200")
    regs, spill = aot._cuda_registers(ck.asm["cubin"])
    assert not spill and regs < 128, (spec.variant, regs, spill)
# the warp-specialized sparse MLA (Gluon kernels) builds for sm_90a: the 32-key seesaw (FP8 rows)
# without spilling; the half-release seesaw (bf16 rows) with at most 24 B of stack (Triton 3.6's
# build keeps a math group's loop values there, 3.7's none; its 224 math registers are the fastest
# measured split, BENCHMARKS.md "Whole-line gathers")
kinds = set()
for spec in aot.collect_specs("h200", families=["mla_sparse_ws"]):
    name = spec.kernel.__name__
    if name not in ("_sparse_ws_kernel", "sparse_half_kernel"):     # the key splits' merge
        continue
    kinds.add(name)
    ck = aot.compile_spec(spec, "h200")
    regs, spill = aot._cuda_registers(ck.asm["cubin"])
    assert (spill or 0) <= (24 if name == "sparse_half_kernel" else 0), (spec.variant, regs, spill)
    assert ck.metadata.shared > 200_000, (spec.variant, ck.metadata.shared)
assert kinds == {"_sparse_ws_kernel", "sparse_half_kernel"}, kinds
# so does the warp-specialized indexer scan (h200's FP8 scan at 4 rows a request), but for
# Triton 3.8's build, which keeps 32 B of its partitions' scalars in local memory (other register
# splits of its partitions spill 24-56 B there; BENCHMARKS.md, "The kernels' sm_90a builds")
ws = [s for s in tix.aot_specs(shapes) if s.kernel.__name__ == "_indexer_ws_kernel"]
assert len(ws) == 1, [s.variant for s in ws]
ck = aot.compile_spec(ws[0], "h200")
spill = aot._cuda_registers(ck.asm["cubin"])[1] or 0
triton_38 = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 8)
assert spill <= (32 if triton_38 else 0) and ck.metadata.shared > 80_000, (spill, ck.metadata.shared)
# the warp-specialized dense MLA (Gluon) at one and four rows a request, bf16 and FP8 rows:
# its planned splits, its descriptors typed with their shared layouts, built for sm_90a
# without spilling but at bf16 R = 4 (two passes planned, by the producer alone), where ptxas
# keeps 8 bytes of the producer's scalars in local memory, and no more
specs = aot.collect_specs("h200", families=["mla_dense_ws"])
names = {(s.kernel.__name__, s.variant) for s in specs}
assert {("dense_ws_kernel", f"{f}R={r},splits=4") for f in ("", "fp8,") for r in (1, 4)} <= names, names
assert not {v for n, v in names if n == "_dense_split_kernel"}, names
for spec in specs:
    if spec.kernel.__name__ != "dense_ws_kernel":
        continue
    box = "u8[64,128]" if spec.variant.startswith("fp8") else "bf16[64,64]"
    assert spec.signature["desc"].startswith(f"tensordesc<{box},NVMMASharedLayout("), spec
    ck = aot.compile_spec(spec, "h200")
    regs, spill = aot._cuda_registers(ck.asm["cubin"])
    assert (spill or 0) <= (8 if spec.variant.startswith("R=4") else 0), (spec.variant, spill)
    assert ck.metadata.shared > 200_000 and ck.metadata.num_warps == 12, spec.variant
print("checked")
"""


def test_every_integer_argument_has_its_value_at_the_shapes():
    """kernel_spec specializes integers as the JIT does (1 a constexpr, a multiple of 16 hinted;
    names that are not integer arguments refused), and each AOT spec gives every integer
    argument its value at the build's shapes, so the build compiles what the launch would run;
    an integer left out would build the kernel's generic form. Also: the launches a target pairs
    by PDL are built as such."""
    out = subprocess.run([sys.executable, "-c", _INTS_PROBE], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "checked", out.stdout


_PDL_PROBE = """
import dataclasses
from k31c.lowering import aot, targets
def build(specs, name):
    spec = next(s for s in specs if s.kernel.__name__ == name)
    ck = aot.compile_spec(spec, "h200")
    ptx = ck.asm["ptx"]
    return (spec.constexprs["PDL"], "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx,
            bool(ck.metadata.launch_pdl))
for pdl in (False, True):
    targets.TARGETS["h200"] = dataclasses.replace(targets.TARGETS["h200"], pdl=pdl)
    print(pdl, *build(aot.collect_specs("h200", families=["cache_write"]), "_latent_write_kernel"))
# the top-k's own chain, with the target's pdl off: the plan lets the filter launch, the filter waits
targets.TARGETS["h200"] = dataclasses.replace(targets.TARGETS["h200"], pdl=False)
topk = aot.collect_specs("h200", families=["topk"])
print(*build(topk, "_plan_kernel"), *build(topk, "_filter_kernel"),
      next(s for s in topk if s.kernel.__name__ == "_refine_kernel").constexprs["PDL"])
# the fused select's chain, target's pdl off: the sample layout lets the sample scan launch, the
# six launches after it wait
from k31c.lowering.triton import indexer_topk
indexer_topk.FUSED_FROM = 0
own = {(s.kernel.__name__, s.variant) for s in indexer_topk.fused_aot_specs(aot.default_shapes("h200"))}
fused = [s for s in aot.collect_specs("h200", families=["indexer_topk"]) if (s.kernel.__name__, s.variant) in own]
print(*build(fused, "_sample_layout_kernel"), len(fused),
      sorted({s.constexprs["PDL"] for s in fused if s.kernel.__name__ != "_sample_layout_kernel"}))
"""


_CAP_PROBE = """
from k31c.lowering import aot
from k31c.lowering.triton.indexer_tma import default_maxnreg
specs = [s for s in aot.collect_specs("h200", families=["indexer"]) if "mxfp8" in s.variant]
binding = []
for s in specs:
    c = s.constexprs
    want = default_maxnreg(True, False, s.num_warps, c["ROWS_PAD"], c["H_PAD"])
    assert s.maxnreg == (want or None), (s.variant, s.maxnreg, want)
    capped = aot.build_spec(s, "h200")
    free = aot.build_spec(s._replace(maxnreg=None), "h200")
    assert capped.n_regs <= s.maxnreg, (s.variant, capped.n_regs)
    binding.append(free.n_regs > s.maxnreg)           # R = 4: the cap binds (209 uncapped)
    gfx = next(g for g in aot.collect_specs("mi350x", families=["indexer"]) if g.variant == s.variant)
    aot.build_spec(gfx, "mi350x")                   # the HIP build takes no cap and still builds
assert any(binding), binding
print("checked", len(specs))
"""


def test_register_caps_are_built_as_launched():
    """A launch's register cap (the MXFP8 TMA indexer's 168 at 4 warps) is part of its AOT
    spec, so the sm_90a build is the code that runs (within the cap, which binds at R = 4); gfx950
    builds of the same spec ignore it (HIP has no such option)."""
    out = subprocess.run([sys.executable, "-c", _CAP_PROBE], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("checked") and out.stdout.strip() != "checked 0", out.stdout


def test_pdl_builds_wait_and_launch_dependents_into_the_kernels():
    """With the target's `pdl`, the sm_90a build of a kernel waits for its producer and lets the
    next kernel launch (griddepcontrol) and is marked for PDL launch; without it, neither. The
    top-k chains its own launches whatever the target says: the plan lets the filter launch, the
    filter and the refine wait (and are launched as dependents); so does the fused select: its
    sample layout lets the sample scan launch, its six launches after that wait."""
    out = subprocess.run([sys.executable, "-c", _PDL_PROBE], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["False False False False False", "True True True True True",
                                          "False False True False True True True True True",
                                          "False False True False 7 [True]"]


_JOBS_PROBE = """
from k31c.lowering import aot
lines = {1: [], 2: []}
built = {j: aot.build_kernels("h200", families=["cache_write", "moe_route"], jobs=j, progress=lines[j].append)
         for j in (2, 1)}
names = [aot.spec_name(s) for s in aot.collect_specs("h200", families=["cache_write", "moe_route"])]
assert [b.name for b in built[2]] == names == [b.name for b in built[1]]     # the specs' order
assert [b.sha256 for b in built[2]] == [b.sha256 for b in built[1]]
assert lines[2] == [b.line() for b in built[2]] and len(lines[2]) == len(names) > 4
print("checked", len(names))
"""


def test_a_build_on_several_processes_is_the_build_in_one():
    """`build_kernels(jobs=2)` (the CLI's default: the usable CPUs) compiles each spec in a
    spawned process that collects the specs itself: the same binaries, and one progress line a
    kernel, both in the specs' order."""
    out = subprocess.run([sys.executable, "-c", _JOBS_PROBE], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("checked"), out.stdout
