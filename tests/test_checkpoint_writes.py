"""Checkpoint writes: deterministic init, atomic saves, confinement of the files a checkpoint
names, in-place replacement that a kill or a failure at any step leaves whole, and write
errors (the tiny model cache: test_tiny_model_cache.py)."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import k31c.checkpoint as ckpt_mod
import k31c.checkpoint_save as save_mod
from k31c.checkpoint import CheckpointError, load_checkpoint
from k31c.checkpoint_save import init_checkpoint, save_checkpoint

from checkpoint_helpers import assert_same_weights, model, random_model, saved  # noqa: F401 (fixtures)


# ---- init and atomic writes ---------------------------------------------------------------------------

def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_init_is_deterministic_per_seed(tmp_path):
    a = _files(init_checkpoint("tiny", 5, tmp_path / "a"))
    b = _files(init_checkpoint("tiny", 5, tmp_path / "b"))
    c = _files(init_checkpoint("tiny", 6, tmp_path / "c"))
    assert a == b
    assert _files(init_checkpoint(tmp_path / "a" / "config.json", 5, tmp_path / "d")) == a
    assert a["config.json"] == c["config.json"] and a["model.safetensors"] != c["model.safetensors"]
    w5 = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert not torch.equal(w5["lm_head.weight"], load_file(str(tmp_path / "c" / "model.safetensors"))["lm_head.weight"])
    assert 0.01 < w5["lm_head.weight"].std() < 0.03  # spec §9.5: N(0, 0.02)


def test_save_refuses_a_non_empty_dir_and_overwrites_only_a_checkpoint(model, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        save_checkpoint(model, out)
    with pytest.raises(CheckpointError, match=r"not a checkpoint's \(keep.txt\)"):
        save_checkpoint(model, out, overwrite=True)   # a user's file: never replaced
    assert _files(out) == {"keep.txt": b"x"}
    (out / "keep.txt").unlink()
    other = random_model(seed=12)
    save_checkpoint(other, out)
    save_checkpoint(model, out, overwrite=True)
    assert sorted(_files(out)) == ["config.json", "model.safetensors"]
    assert_same_weights(model, load_checkpoint(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind


def test_failed_save_leaves_nothing(model, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(save_mod, "save_file", broken)
    with pytest.raises(OSError):
        save_checkpoint(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


# ---- confinement, odd files, replacing, stale temporaries, modes ----------------------------------

@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory):
    return save_checkpoint(model, tmp_path_factory.mktemp("sharded") / "ckpt", shard_max_bytes=4 * 2**20)


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_weight_map_entries_outside_the_directory_named(sharded, tmp_path, escape):
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(sharded, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "x.safetensors"
    shutil.copy(d / first, outside)         # a real shard, so only the place is wrong
    entry = {"dotdot": "../x.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[escape]
    if escape == "symlink":
        (d / "link.safetensors").symlink_to(outside)
    for name, f in index["weight_map"].items():
        if f == first:
            index["weight_map"][name] = entry
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / first).unlink()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert f"to '{entry}', which is outside the checkpoint directory" in msg
    name = next(n for n, f in index["weight_map"].items() if f == entry)
    assert f"maps '{name}'" in msg


def test_weights_that_are_directories_named(saved, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_bytes((saved / "config.json").read_bytes())
    (d / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors is a directory or special file"):
        load_checkpoint(d)
    (d / "model.safetensors").rmdir()
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="config.json is not a file"):
        load_checkpoint(d)


def test_overwrite_of_the_working_directory_replaces_the_files_in_place(model, tmp_path, monkeypatch):
    out = save_checkpoint(random_model(seed=12), tmp_path / "ckpt")
    monkeypatch.chdir(out)
    save_checkpoint(model, ".", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]   # no `..old-*`, no temporaries
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_weights(model, load_checkpoint(out))


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_of_dead_processes_are_cleaned(model, tmp_path):
    dead = _dead_pid()
    stale_dir = tmp_path / f".ckpt.tmp-{dead}-abc"
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"x" * 100)
    stale_file = tmp_path / f".ckpt.tmp-{dead}-def.tmp"
    stale_file.write_bytes(b"x")
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-ghi"   # a live process's: left alone
    live.mkdir()
    other = tmp_path / f".other.tmp-{dead}-jkl"          # another output's: left alone
    other.mkdir()
    save_checkpoint(model, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name, other.name])


def test_a_checkpoint_moved_aside_by_a_killed_process_is_put_back(model, tmp_path):
    old = tmp_path / f".ckpt.old-{_dead_pid()}-abc"
    old.mkdir()
    save_checkpoint(model, old / "ckpt")
    from k31c.fsutil import clean_stale
    assert clean_stale(tmp_path, "ckpt") == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_same_weights(model, load_checkpoint(tmp_path / "ckpt"))


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_files_get_the_mode_of_the_umask(model, tmp_path, mask):
    from k31c.fsutil import write_atomic
    previous = os.umask(mask)
    try:
        out = save_checkpoint(model, tmp_path / "ckpt")
        write_atomic(tmp_path / "f.bin", lambda f: f.write(b"data"))
    finally:
        os.umask(previous)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    for p in [*out.iterdir(), tmp_path / "f.bin"]:
        assert (p.stat().st_mode & 0o777) == 0o666 & ~mask, p
    assert (tmp_path / "f.bin").read_bytes() == b"data"


# ---- replacing a checkpoint that cannot be renamed: whole after a failure or a kill at any step ----

def _replace_in_child(new: Path, target: Path, names: list[str], kill_at: int) -> bool:
    """fsutil.replace_files in a forked child that SIGKILLs itself at its `kill_at`-th rename (no
    clean-up of any kind runs, as after a real SIGKILL); whether it was killed."""
    import signal

    from k31c import fsutil
    pid = os.fork()
    if pid == 0:
        calls = [0]

        def rename(real):
            def counted(a, b):
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(a, b)
            return counted
        fsutil.os.rename, fsutil.os.replace = rename(os.rename), rename(os.replace)
        try:
            fsutil.replace_files(new, target, names)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == 0
    return os.WIFSIGNALED(status)


def _two_file_sets(tmp_path: Path) -> tuple[Path, dict, Path, dict]:
    """An old directory of files and a new one with partly the same names (config.json) and partly
    others, as a single-file checkpoint replaced by a sharded one."""
    target, new = tmp_path / "ckpt", tmp_path / f".ckpt.tmp-{_dead_pid()}-x"   # as a killed writer's
    old_files = {"config.json": b"old config", "model.safetensors": b"old weights"}
    new_files = {"config.json": b"new config", "model.safetensors.index.json": b"new index",
                 "model-00001-of-00002.safetensors": b"new 1", "model-00002-of-00002.safetensors": b"new 2"}
    for d, files in ((target, old_files), (new, new_files)):
        d.mkdir()
        for name, data in files.items():
            (d / name).write_bytes(data)
    return target, old_files, new, new_files


RENAMES = 1 + 2 + 1 + 4   # new dir aside, 2 old files aside, aside -> ckpt, 4 new files in


@pytest.mark.parametrize("kill_at", range(1, RENAMES + 2))
def test_in_place_replacement_killed_at_any_rename_is_finished_or_undone(tmp_path, kill_at):
    from k31c.fsutil import clean_stale
    target, old_files, new, new_files = _two_file_sets(tmp_path)
    killed = _replace_in_child(new, target, sorted(old_files), kill_at)
    assert killed == (kill_at <= RENAMES)
    if killed:
        clean_stale(tmp_path, "ckpt")   # what the next write (or a reader) does
    # killed before the 4th rename (the old files all aside): undone; after it: finished
    assert _files(target) == (old_files if kill_at <= 4 else new_files)
    assert _entries(tmp_path) == ["ckpt"]


def _interrupt_rename(monkeypatch, fail_at: int) -> None:
    """Ctrl-C at the `fail_at`-th os.rename / os.replace from now on."""
    calls = [0]

    def counted(real):
        def rename(a, b):
            calls[0] += 1
            if calls[0] == fail_at:
                raise KeyboardInterrupt
            return real(a, b)
        return rename
    monkeypatch.setattr(os, "rename", counted(os.rename))
    monkeypatch.setattr(os, "replace", counted(os.replace))


@pytest.mark.parametrize("fail_at", range(1, RENAMES + 1))
def test_in_place_replacement_interrupted_at_any_rename_is_finished_or_undone(tmp_path, monkeypatch,
                                                                              fail_at):
    from k31c.fsutil import replace_files
    target, old_files, new, new_files = _two_file_sets(tmp_path)
    _interrupt_rename(monkeypatch, fail_at)
    with pytest.raises(KeyboardInterrupt):
        replace_files(new, target, sorted(old_files))
    monkeypatch.undo()
    assert _files(target) == (old_files if fail_at <= 4 else new_files)
    assert [p.name for p in tmp_path.iterdir() if ".old-" in p.name] == []


def _entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A one-file checkpoint of other weights, replaced by `sharded` below."""
    return save_checkpoint(random_model(seed=12), tmp_path_factory.mktemp("single") / "ckpt")


@pytest.mark.parametrize("fail_at", range(1, 13))   # 11 renames: 1 + 2 old files + 1 + 7 new files
def test_init_force_in_the_working_directory_interrupted_keeps_a_whole_checkpoint(
        model, single, sharded, tmp_path, monkeypatch, fail_at):
    """The audit's repro: Ctrl-C between two renames of `save_checkpoint(..., ".", overwrite=True)`
    left new weights beside the old config.json."""
    import shutil
    out = shutil.copytree(single, tmp_path / "ckpt")
    monkeypatch.chdir(out)
    _interrupt_rename(monkeypatch, fail_at)
    try:
        save_checkpoint(model, ".", overwrite=True, shard_max_bytes=4 * 2**20)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert _files(out) in (_files(single), _files(sharded))
    assert _entries(tmp_path) == ["ckpt"]


# ---- readers after a killed `init --force` ----------------------------------------------------------

def test_readers_restore_a_checkpoint_moved_aside_by_a_killed_swap(model, tmp_path):
    from k31c.cli.common import checkpoint_dir
    for read in (lambda p: checkpoint_dir(str(p)), load_checkpoint):
        old = tmp_path / f".ckpt.old-{_dead_pid()}-abc"
        save_checkpoint(model, old / "ckpt")
        read(tmp_path / "ckpt")
        assert _entries(tmp_path) == ["ckpt"]
        assert_same_weights(model, load_checkpoint(tmp_path / "ckpt"))
        import shutil
        shutil.rmtree(tmp_path / "ckpt")


def test_a_missing_checkpoint_error_names_where_a_live_swap_keeps_it(model, tmp_path):
    from k31c.cli.common import checkpoint_dir
    from k31c.errors import UsageError
    aside = tmp_path / f".ckpt.old-{os.getpid()}-abc"   # a live process's: not touched
    (aside / "ckpt").mkdir(parents=True)
    with pytest.raises(UsageError, match=f"does not exist \\(a replacement left the previous one in {aside}"):
        checkpoint_dir(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=f"a replacement left the previous one in {aside}"):
        load_checkpoint(tmp_path / "ckpt")


# ---- write errors: a full disk, an unwritable directory ---------------------------------------------

def _full_disk(*args, **kwargs):
    from safetensors import SafetensorError
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_is_an_os_error_naming_the_output(model, tmp_path, monkeypatch, capsys):
    import errno

    from k31c.cli import main
    monkeypatch.setattr(save_mod, "save_file", _full_disk)
    with pytest.raises(OSError) as e:
        save_checkpoint(model, tmp_path / "ckpt")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "ckpt")
    assert main(["init", "--out", str(tmp_path / "ckpt")]) == 1
    assert capsys.readouterr().err == f"k31c: error: No space left on device: {tmp_path}/ckpt\n"
    assert _entries(tmp_path) == []


def test_a_directory_that_cannot_be_written_is_named_not_the_temporary(model, tmp_path, monkeypatch):
    from k31c import fsutil

    def denied(dir, prefix):
        raise PermissionError(13, "Permission denied", f"{dir}/{prefix}abc")
    monkeypatch.setattr(fsutil.tempfile, "mkdtemp", lambda dir, prefix: denied(dir, prefix))
    with pytest.raises(PermissionError) as e:
        save_checkpoint(model, tmp_path / "b")
    assert e.value.filename == str(tmp_path / "b")


def test_an_unreadable_weights_file_is_named_with_the_real_reason(saved, monkeypatch):
    real_open = open

    def no_weights(path, *args, **kwargs):
        if Path(path).name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(ckpt_mod, "open", no_weights, raising=False)
    with pytest.raises(CheckpointError, match="cannot read model.safetensors: Permission denied"):
        load_checkpoint(saved)


def test_a_config_that_is_a_fifo_is_named_as_such(saved, tmp_path, capsys):
    from k31c.cli import main
    d = tmp_path / "ckpt"
    d.mkdir()
    os.mkfifo(d / "config.json")
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi"]) == 2
    assert "config.json is not a file" in capsys.readouterr().err
