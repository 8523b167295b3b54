"""The compile cache: the store (compile_cache.py: entries, manifests, damage, locks, misses
explained) on small files, and one step program through it (cached_program.py): built once into
an entry, then loaded by another compile with no capture and no code generation, computing what
eager computes. The one cold build (the decode step of the tiny model) takes ~15 s here."""
import json
import os
import threading
import time

import pytest
import torch

import k31c.api as k31c_api
from k31c.cached_program import cache_root, factors
from k31c.cli import main
from k31c.compile_cache import CompileCache, Damaged, key_of
from k31c.errors import UsageError
from k31c.graph.capture import StepKind
from k31c.graph.step import step_meta
from k31c.runtime.engine import Engine
from tiny_model import close, engine_scenario, make_model

FACTS = {"torch": "2.x", "target": "cpu", "step": "decode", "config": {"layers": 8},
         "source": {"api.py": "aa", "passes/lower.py": "bb"}}


def publish(cache: CompileCache, facts=FACTS, files=None):
    name = cache.name(facts["step"], facts)
    with cache.locked(name), cache.building(name) as tmp:
        for rel, data in (files or {"program.bin": os.urandom(3000), "inductor/ab/x.py": b"print(1)\n"}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        return cache.publish(tmp, name, facts, {"note": "x"})


# ---- the store ------------------------------------------------------------------------------------

def test_an_entry_is_found_whole_with_its_factors_in_clear_text(tmp_path):
    cache = CompileCache(tmp_path)
    entry = publish(cache)
    found = cache.lookup(entry.name)
    assert found.manifest["factors"] == json.loads(json.dumps(FACTS))
    assert set(found.manifest["files"]) == {"program.bin", "inductor/ab/x.py"}
    assert found.manifest["files"]["program.bin"][0] == 3000
    assert entry.name.startswith("decode-")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".locks"] == []


def test_the_key_changes_with_every_factor_and_not_with_order():
    base = key_of(FACTS)
    assert key_of(dict(reversed(list(FACTS.items())))) == base
    for k in FACTS:
        changed = dict(FACTS, **{k: "other"})
        assert key_of(changed) != base, k
    assert key_of(dict(FACTS, source={"api.py": "aa", "passes/lower.py": "bc"})) != base


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "has 100 bytes, the manifest says 3000"),
    ("flip", "does not match its SHA-256"),
    ("delete", "program.bin is missing"),
    ("no-manifest", "no manifest.json"),
    ("bad-manifest", "unreadable manifest.json"),
])
def test_a_damaged_entry_is_refused_with_the_reason(tmp_path, damage, reason):
    cache = CompileCache(tmp_path)
    entry = publish(cache)
    f = entry.path / "program.bin"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[1234] ^= 1
        f.write_bytes(bytes(data))
    elif damage == "delete":
        f.unlink()
    elif damage == "no-manifest":
        (entry.path / "manifest.json").unlink()
    else:
        (entry.path / "manifest.json").write_text('{"format": 1, "fil')
    with pytest.raises(Damaged, match=reason):
        cache.lookup(entry.name)
    [(path, listed, problem)] = cache.entries()
    assert listed is None and reason in problem
    # publishing the rebuilt entry replaces the damaged one
    rebuilt = publish(cache)
    assert cache.lookup(rebuilt.name).name == entry.name


def test_a_build_that_fails_halfway_leaves_nothing(tmp_path):
    cache = CompileCache(tmp_path)
    name = cache.name("decode", FACTS)
    with pytest.raises(RuntimeError, match="boom"):
        with cache.locked(name), cache.building(name) as tmp:
            (tmp / "program.bin").write_bytes(b"half")
            raise RuntimeError("boom")
    assert cache.lookup(name) is None
    assert [p.name for p in tmp_path.iterdir()] == [".locks"]


def test_a_second_builder_waits_for_the_first(tmp_path):
    cache = CompileCache(tmp_path)
    name = cache.name("decode", FACTS)
    order, inside = [], threading.Event()

    def first():
        with cache.locked(name):
            inside.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=first)
    t.start()
    inside.wait()
    with cache.locked(name):            # a separate open file: flock blocks it as another process
        order.append("second in")
    t.join()
    assert order == ["first done", "second in"]


def test_a_miss_names_the_factors_the_nearest_entry_differs_in(tmp_path):
    cache = CompileCache(tmp_path)
    publish(cache)
    publish(cache, dict(FACTS, torch="2.y", config={"layers": 9}))
    near = cache.nearest("decode", dict(FACTS, source={"api.py": "aa", "passes/lower.py": "cc"}))
    assert near[1] == ["source (passes/lower.py)"]
    assert cache.nearest("prefill", FACTS) is None


def test_cache_list_prune_and_clear(tmp_path, capsys):
    import sys
    from k31c.cached_program import source_digests
    cache = CompileCache(tmp_path)
    current = dict(FACTS, torch=torch.__version__, python="%d.%d" % sys.version_info[:2], source=source_digests())
    good = publish(cache, current)
    old = publish(cache, dict(current, source=dict(source_digests(), **{"api.py": "0"})))
    bad = publish(cache, dict(current, target="h200"))
    (bad.path / "program.bin").write_bytes(b"x")
    assert main(["cache", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and f"{good.name}" in out and f"target=cpu torch={torch.__version__}" in out
    assert f"{bad.name}" in out and "DAMAGED: program.bin has 1 bytes" in out
    assert "STALE: built from other k31c sources (1 files differ, e.g. api.py)" in out
    assert main(["cache", "prune", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 2 of 3 entries" in capsys.readouterr().out
    assert [e.name for _, e, _ in cache.entries()] == [good.name] and not old.path.exists()
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 1 of 1 entries" in capsys.readouterr().out
    assert cache.entries() == []


def test_the_cache_option_and_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("K31C_COMPILE_CACHE", "off")
    assert cache_root(None) is None and cache_root(tmp_path) == tmp_path
    monkeypatch.setenv("K31C_COMPILE_CACHE", str(tmp_path / "c"))
    assert cache_root(None) == tmp_path / "c" and cache_root(False) is None
    with pytest.raises(UsageError, match="option cache must be a directory, True .* got 5"):
        k31c_api.compile(make_model(), target="cpu", options={"cache": 5})


def test_cli_refusals(tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
    assert "--target eager compiles nothing" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--dense-codegen", "iree"]) == 2
    assert "--dense-codegen applies to a compiled target" in capsys.readouterr().err
    assert main(["prebuild", "--steps", "decode,verify1", "--cache-dir", str(tmp_path)]) == 2
    assert "verifyR with R >= 2" in capsys.readouterr().err
    assert main(["prebuild", "--target", "eager"]) == 2
    assert main(["prebuild", "--jit-workers", "-1", "--cache-dir", str(tmp_path)]) == 2
    assert "--jit-workers: must be 0 or more, got -1" in capsys.readouterr().err
    assert main(["prebuild", "--max-seq-len", "99999999", "--cache-dir", str(tmp_path)]) == 2
    assert "exceeds the model's maximum length" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["prebuild", "--cache-dir", str(tmp_path / "a-file")]) == 2
    assert "the compile cache cannot take entries: " in capsys.readouterr().err


def test_the_cli_knows_every_target_and_code_generator():
    from k31c.cli.common import DENSE_CODEGEN_NAMES, TARGET_NAMES
    from k31c.lowering.build import DENSE_CODEGENS
    from k31c.lowering.targets import TARGETS
    assert set(TARGET_NAMES) == set(TARGETS) and DENSE_CODEGEN_NAMES == DENSE_CODEGENS


# ---- a step program through the cache -------------------------------------------------------------

POOL = dict(max_requests=4, max_seq_len=128)       # engine_scenario's pool


def routed(model, compiled):
    """Prefill and verification eager, decode through `compiled`."""
    def step_fn(ids, meta, caches, mode="prefill", rows=1):
        fn = compiled if (mode, rows) == ("decode", 1) else model
        return fn(ids, meta, caches, mode, rows)
    return step_fn


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile-cache")
    model = make_model()
    cold = k31c_api.compile(model, target="cpu", options={"cache": root})
    assert cold.prebuild(Engine(cold, **POOL), ["decode"]) is False   # the cpu's kernels: built, not run
    return model, root, cold


def test_a_second_compile_loads_the_program_without_building(built, monkeypatch, capsys):
    model, root, cold = built
    assert cold.report.steps["decode"].cache.startswith("miss: no decode entry")
    [(path, entry, problem)] = CompileCache(root).entries()
    assert problem is None and entry.step == "decode"
    assert (path / "graph.txt").read_text().count("k31c.sparse_mla") == 2
    assert any(f.endswith(".so") for f in entry.manifest["files"])    # the C++ kernels, built

    import torch._inductor as inductor
    import torch._inductor.compile_fx as compile_fx

    def no_compile(*a, **k):
        raise AssertionError("the warm start compiled")
    monkeypatch.setattr(inductor, "standalone_compile", no_compile)
    monkeypatch.setattr(compile_fx, "compile_fx", no_compile)
    monkeypatch.setattr(k31c_api, "capture_cached", no_compile)
    warm = k31c_api.compile(model, target="cpu", options={"cache": root})
    got = engine_scenario(model, routed(model, warm), [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 4)
    report = warm.report.steps["decode"]
    assert report.cache.startswith(f"hit {path.name}") and warm.compilations == {"decode": 1}
    assert report.kernels == cold.report.steps["decode"].kernels
    assert "decode" not in warm.graphs and "loaded from the compile cache" in str(warm.report)
    monkeypatch.undo()
    close(got, engine_scenario(model, model, [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 4), tol=2e-5)


def test_a_damaged_program_is_reported_not_loaded(built, capsys, tmp_path):
    model, root, cold = built
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    [(path, entry, _)] = CompileCache(copy).entries()
    f = path / "program.bin"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    compiled = k31c_api.compile(model, target="cpu", options={"cache": copy})
    loaded, note = compiled.cache.load(model, StepKind("decode"), path.name)
    assert loaded is None and note == "damaged entry rebuilt"
    assert "program.bin does not match its SHA-256" in capsys.readouterr().err


def test_a_changed_option_misses_and_says_why(built):
    model, root, cold = built
    other = k31c_api.compile(model, target="cpu", options={"cache": root, "quantize": {"mxfp8_indexer": True}})
    pool = Engine(other, **POOL).pool                 # MXFP8 index keys: another pool too
    meta = step_meta(slot_mapping=[0, 1], block_table=torch.zeros(2, pool.block_table.shape[1]),
                     row_req=[0, 1], row_len=[1, 1], kda_slots=[0, 1], cu_seqlens=[0, 1, 2])
    step = StepKind("decode")
    facts = factors(other, step, meta, pool.caches())
    assert other.cache.miss_reason(step, facts).endswith("differs in: geometry, pass_options")



def test_a_gpu_target_program_goes_through_the_cache(tmp_path, monkeypatch):
    """The h200 program (executor "program": dense pieces + bound Triton kernels, here run by
    the interpreter on CPU tensors): built once, then loaded with its steps and kernels bound
    again, computing what eager computes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the h200 program on the CPU through the Triton interpreter")
    model = make_model()
    cold = k31c_api.compile(model, target="h200", options={"cache": tmp_path})
    cold.prebuild(Engine(cold, **POOL), ["decode"])
    [(path, entry, _)] = CompileCache(tmp_path).entries()
    pieces = entry.manifest["info"]["program"]["piece_names"]
    assert len(pieces) > 1 and all(f"pieces/{i}.bin" in entry.manifest["files"] for i in range(len(pieces)))

    import torch._inductor as inductor
    monkeypatch.setattr(inductor, "standalone_compile", lambda *a, **k: pytest.fail("the warm start compiled"))
    monkeypatch.setattr(k31c_api, "capture_cached", lambda *a, **k: pytest.fail("the warm start captured"))
    warm = k31c_api.compile(model, target="h200", options={"cache": tmp_path})
    got = engine_scenario(model, routed(model, warm), [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2)
    assert warm.report.steps["decode"].cache.startswith(f"hit {path.name}")
    assert warm.programs["decode"].describe() == cold.programs["decode"].describe()
    assert warm.report.steps["decode"].fallbacks == {}
    monkeypatch.undo()
    close(got, engine_scenario(model, model, [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2), tol=2e-5)


def test_the_trace_example_avoids_the_static_sizes():
    """A symbolic size equal to a static one at the trace's example was taken for the same size
    by torch 2.11's standalone_compile (a verify4 piece read the block table's width, 8, as its
    rows, B x R = 8 at B = 2): the example's sizes avoid every static size of the step's inputs."""
    from k31c.graph.capture import StepKind, example_sizes, static_sizes
    assert example_sizes(StepKind("decode", 4), {8, 4, 512}) == (5, 20)     # 2: 8; 3, 4: 4
    assert example_sizes(StepKind("decode", 1), {3, 512}) == (4, 4)           # B + 1 = 3 at 2
    assert example_sizes(StepKind("prefill", 1), {3, 6, 7}) == (4, 8)        # B: not 2, 3; T: not 6, 7
    model = make_model()
    pool = Engine(model, **POOL).pool
    from k31c.graph.step import step_meta
    meta = step_meta(slot_mapping=[0], block_table=pool.block_table[:1], row_req=[0], row_len=[1],
                     kda_slots=[0], cu_seqlens=[0, 1], device="cpu")
    static = static_sizes(model, StepKind("decode", 4), meta, pool.caches(pool.new_snapshots(1, 4)))
    assert {8, 4, model.config.vocab_size, model.config.hidden_size} <= static


def test_step_inputs_record_round_trip():
    import sympy
    from k31c.cached_program import step_inputs_from_record, step_inputs_record
    from k31c.runtime.staging import StepInputs
    b = sympy.Symbol("s17", integer=True, positive=True)
    s = StepInputs([3, 4, 9], ["input_ids", "meta.block_table", "caches.kda_snapshots.0.conv"],
                   [(4 * b,), (b, 8), (b, 4, 96, 3)], [9], b, 4)
    back = step_inputs_from_record(json.loads(json.dumps(step_inputs_record(s))))
    assert back == s and back.shapes[0][0].xreplace({b: 3}) == 12


@pytest.mark.parametrize("why", ["artifact", "unwritable"])
def test_a_program_that_cannot_be_stored_is_built_without_the_cache(tmp_path, monkeypatch, capsys, why):
    import k31c.cached_program as cached_program
    from k31c.backend import make_executor
    from k31c.errors import ArtifactError

    root = tmp_path / "cache"
    if why == "artifact":
        def refuse(*a, **k):
            raise ArtifactError("RuntimeError: vr must not be None")
        monkeypatch.setattr(cached_program, "save_artifact", refuse)
        expect = "Inductor could not make a standalone artifact (RuntimeError: vr must not be None)"
    else:
        root.write_text("a file where the cache directory should be")
        expect = f"the compile cache cannot take it ({root}: cannot create it"
    built_fx = []
    monkeypatch.setattr(k31c_api, "make_executor", lambda gm, ex, executor, t: built_fx.append(executor)
                        or make_executor(gm, ex, "fx", t))        # quick: no code generation
    model = make_model()
    compiled = k31c_api.compile(model, target="cpu", options={"cache": root})
    got = engine_scenario(model, routed(model, compiled), [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2)
    assert built_fx == ["inductor"]
    assert compiled.report.steps["decode"].cache.startswith("not stored: " + expect)
    assert f"the decode program is not stored: {expect}" in capsys.readouterr().err
    if why == "artifact":
        assert CompileCache(root).entries() == []
    close(got, engine_scenario(model, model, [(0, 40), (0, 5), (7, 18)], 100, (0, 2), 2), tol=2e-5)


def test_a_read_only_cache_loads_from_a_copy(built, monkeypatch):
    """A prebuilt cache shipped read-only: loading (which rewrites Inductor's entries and takes
    locks) works on a temporary copy and leaves the entry as it was."""
    import k31c.cached_program as cached_program
    model, root, cold = built
    [(path, _, _)] = CompileCache(root).entries()
    before = sorted((p.relative_to(path).as_posix(), p.stat().st_mtime_ns) for p in path.rglob("*"))
    real_access = os.access
    monkeypatch.setattr(cached_program.os, "access",
                        lambda p, mode: False if str(p).startswith(str(path)) else real_access(p, mode))
    warm = k31c_api.compile(model, target="cpu", options={"cache": root})
    warm.prebuild(Engine(warm, **POOL), ["decode"])
    assert warm.report.steps["decode"].cache.startswith("hit")
    assert sorted((p.relative_to(path).as_posix(), p.stat().st_mtime_ns) for p in path.rglob("*")) == before


def test_a_builder_that_finds_the_entry_written_meanwhile_loads_it(built, monkeypatch):
    """Two processes missed at once: the second to take the lock loads the first one's entry."""
    from k31c.cached_program import ProgramCache
    model, root, cold = built
    monkeypatch.setattr(ProgramCache, "load", lambda self, model, step, name: (None, "miss"))
    other = k31c_api.compile(model, target="cpu", options={"cache": root})
    other.prebuild(Engine(other, **POOL), ["decode"])
    assert "built meanwhile" in other.report.steps["decode"].cache
    assert other.programs == {} and len(CompileCache(root).entries()) == 1


def test_a_killed_builders_temporary_is_removed_by_the_next(tmp_path):
    cache = CompileCache(tmp_path)
    name = cache.name("decode", FACTS)
    dead = 2 ** 22 + 12345                       # above Linux's default pid_max: no such process
    stale = tmp_path / f".{name}.tmp-{dead}-abc"
    stale.mkdir(parents=True)
    (stale / "program.bin").write_bytes(b"half")
    publish(cache)
    assert not stale.exists() and cache.lookup(name) is not None


def test_no_cpp_compiler_is_one_line_and_leaves_no_entry(tmp_path):
    import subprocess
    import sys
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "K31C_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-m", "k31c", "generate", "--prompt", "Hi", "--max-new-tokens", "2",
                          "--target", "cpu", "--cache-dir", str(tmp_path / "cache")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("k31c: error: Inductor builds the dense code of CPU tensors as C++") and "$CXX" in last
    assert "Traceback" not in out.stderr
    assert CompileCache(tmp_path / "cache").entries() == []


def test_an_entry_loads_under_the_isa_it_was_built_for_without_the_probe():
    """The cpu entries record the vector ISA Inductor built them for; a process that has not
    probed its ISAs loads under it with Inductor's probe skipped (`vec_isa_ok`) when the CPU's
    own pick is that ISA, and probes as usual otherwise; either way the unprobed list is dropped
    after, and a process that has probed keeps its list."""
    from torch._inductor import config, cpu_vec_isa
    from k31c.cached_program import _vec_isa_as_built
    isas = cpu_vec_isa.valid_vec_isa_list
    isas.cache_clear()
    with config.patch({"cpp.vec_isa_ok": True}):
        mine = str(cpu_vec_isa.pick_vec_isa())
    isas.cache_clear()
    with _vec_isa_as_built(mine):
        assert config.cpp.vec_isa_ok is True and str(cpu_vec_isa.pick_vec_isa()) == mine
    assert config.cpp.vec_isa_ok is None and isas.cache_info().currsize == 0
    with _vec_isa_as_built("an isa of another machine"):
        assert config.cpp.vec_isa_ok is None and isas.cache_info().currsize == 0   # Inductor's own probe
    isas()                                           # probed (by Inductor, in this process)
    with _vec_isa_as_built(mine):
        assert config.cpp.vec_isa_ok is None
    assert isas.cache_info().currsize == 1
