"""The kernel store (runtime/kernel_store.py): Triton's cache manager rooted in the compile cache
while a program runs. Its lookups and writes against Triton's own cache; a real Triton compile
(for sm_90, no GPU needed, in a subprocess without the interpreter) kept in a store, loaded from
a copy of it elsewhere without compiling; `k31c cache` listing and clearing it. (On the GPU,
tests/runtime/test_gpu_compile_cache.py checks a warm start with a fresh Triton cache compiles
no kernel.)"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k31c.cli import main
from k31c.runtime import kernel_store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    """Triton's own cache in a temporary directory, the store-aware manager installed (and the
    process's manager class put back after)."""
    from triton import knobs
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-own"))
    before = knobs.cache.manager_class
    assert kernel_store.install() is None
    yield tmp_path / "triton-own"
    knobs.cache.manager_class = before


def _put_kernel(manager, name: str, payload: bytes) -> dict:
    group = {f"{name}.cubin": manager.put(payload, f"{name}.cubin", binary=True),
             f"{name}.json": manager.put(json.dumps({"name": name}), f"{name}.json", binary=False)}
    manager.put_group(f"{name}.json", group)
    return group


def test_the_store_holds_what_is_written_inside_and_moves(triton_cache, tmp_path):
    from triton.runtime.cache import get_cache_manager
    store = tmp_path / "cache" / kernel_store.STORE_DIR
    with kernel_store.keeping(str(store)):
        m = get_cache_manager("0a1b")
        assert m.get_group("k.json") is None                  # a miss: Triton compiles then
        written = _put_kernel(m, "k", b"\x7fELF-one")
    assert all(Path(p).parent == store / m.key for p in written.values())
    assert not (triton_cache / m.key / "__grp__k.json").exists()    # Triton's own cache untouched
    moved = tmp_path / "elsewhere" / kernel_store.STORE_DIR   # the cache copied to another machine
    shutil.copytree(store, moved)
    shutil.rmtree(store)
    with kernel_store.keeping(str(moved)):
        group = get_cache_manager("0a1b").get_group("k.json")
    assert group == {"k.cubin": str(moved / m.key / "k.cubin"), "k.json": str(moved / m.key / "k.json")}
    assert Path(group["k.cubin"]).read_bytes() == b"\x7fELF-one"
    os.remove(moved / m.key / "k.cubin")                      # a group missing a file is a miss
    with kernel_store.keeping(str(moved)):
        assert get_cache_manager("0a1b").get_group("k.json") is None
    kernels, size = kernel_store.summary(moved)
    assert kernels == 1 and size == sum(f.stat().st_size for f in (moved / m.key).iterdir() if f.is_file())


def test_outside_keeping_triton_s_cache_is_as_before_and_feeds_the_store(triton_cache, tmp_path):
    from triton.runtime.cache import get_cache_manager
    own = get_cache_manager("0a2b")
    assert Path(own.cache_dir).parent == triton_cache
    _put_kernel(own, "k", b"\x7fELF-two")
    store = tmp_path / "store"
    with kernel_store.keeping(str(store)):
        group = get_cache_manager("0a2b").get_group("k.json")      # copied over, not compiled
    assert group is not None and all(Path(p).parent == store / own.key for p in group.values())
    assert Path(group["k.cubin"]).read_bytes() == b"\x7fELF-two"
    assert kernel_store.summary(store)[0] == 1


def test_a_process_s_own_cache_manager_is_kept(triton_cache):
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    class Mine(FileCacheManager):
        pass
    knobs.cache.manager_class = Mine
    why = kernel_store.install()
    assert knobs.cache.manager_class is Mine and "Triton's cache manager is" in why and "Mine" in why


_COMPILE = r"""
import json, sys, shutil
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k31c.runtime import kernel_store

@triton.jit
def scale(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 3.0, mask=i < n)

builds = []
triton.knobs.compilation.listener = lambda *, cache_hit, **_: builds.append(cache_hit)
assert kernel_store.install() is None
src = ASTSource(fn=scale, signature={"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                constexprs={"BLOCK": 128})
with kernel_store.keeping(sys.argv[1]):
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
print(json.dumps({"builds": builds, "asm": sorted(kernel.asm)}))
"""


def _compile_in(store: Path, triton_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(triton_dir), PYTHONPATH=str(ROOT))
    script = store.parent.parent / "compile_probe.py"        # @triton.jit needs a source file
    script.write_text(_COMPILE)
    out = subprocess.run([sys.executable, str(script), str(store)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_compiled_kernel_loads_from_a_copied_store_without_compiling(tmp_path):
    first = _compile_in(tmp_path / "a" / ".triton", tmp_path / "triton-a")
    assert first["builds"] == [False] and "cubin" in first["asm"]
    assert kernel_store.summary(tmp_path / "a" / ".triton")[0] == 1
    assert not any(p.name.startswith("__grp__") for p in (tmp_path / "triton-a").rglob("*"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")          # another machine, a fresh Triton cache
    again = _compile_in(tmp_path / "b" / ".triton", tmp_path / "triton-b")
    assert again["builds"] == [True] and again["asm"] == first["asm"]


def test_cache_list_and_clear_count_the_kernels(tmp_path, capsys, triton_cache):
    from triton.runtime.cache import get_cache_manager
    with kernel_store.keeping(str(tmp_path / "c" / kernel_store.STORE_DIR)):
        _put_kernel(get_cache_manager("0a3b"), "k", b"\x7fELF")
    assert main(["cache", "list", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "0 entries; 1 Triton kernel of k31c's" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "removed 0 of 0 entries and 1 Triton kernel (" in capsys.readouterr().out
    assert not (tmp_path / "c" / kernel_store.STORE_DIR).exists()
