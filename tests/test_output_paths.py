"""Output paths as a user gives them: symbolic links, devices and FIFOs, a trailing separator, an
empty path, a directory that may not be written. Each is checked before anything is built and never
turns into something else (a link or a device replaced by a regular file)."""
import errno
import os
import stat
from pathlib import Path

import pytest

from k31c.cli import main
from k31c.cli.common import output_file
from k31c.errors import UsageError
from k31c.fsutil import write_atomic


def _write(data: bytes):
    return lambda f: f.write(data)


@pytest.fixture
def no_init(monkeypatch):
    """`init` must refuse its --out before the model is built."""
    import k31c.checkpoint_save

    def built(*a, **k):
        raise AssertionError("the model was built before --out was checked")
    monkeypatch.setattr(k31c.checkpoint_save, "init_checkpoint", built)


# ---- write_atomic: what is at the path stays what it is -------------------------------------------

def test_a_symlink_output_replaces_its_target_and_stays_a_link(tmp_path):
    (tmp_path / "real.txt").write_bytes(b"old")
    link = tmp_path / "lnk.txt"
    link.symlink_to("real.txt")
    write_atomic(link, _write(b"new"))
    assert link.is_symlink() and os.readlink(link) == "real.txt"
    assert (tmp_path / "real.txt").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lnk.txt", "real.txt"]  # no temporaries


def test_a_dangling_symlink_output_creates_its_target(tmp_path):
    link = tmp_path / "lnk.txt"
    link.symlink_to("made.txt")
    write_atomic(link, _write(b"new"))
    assert link.is_symlink() and (tmp_path / "made.txt").read_bytes() == b"new"


def test_a_fifo_output_is_written_into(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # so that the writer's open returns
    try:
        write_atomic(fifo, _write(b"through the pipe"))
        assert os.read(reader, 100) == b"through the pipe"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_device_output_is_written_into_not_replaced(tmp_path):
    dev = tmp_path / "nulldev"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # what /dev/null is
    except PermissionError:
        pytest.skip("mknod needs root")
    write_atomic(dev, _write(b"gone"))
    mode = os.lstat(dev).st_mode
    assert stat.S_ISCHR(mode) and os.lstat(dev).st_rdev == os.makedev(1, 3)
    assert output_file(str(dev), "-o") == dev


def test_a_failed_write_names_the_output_not_the_temporary(tmp_path):
    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "x.npy", full)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "x.npy")
    assert list(tmp_path.iterdir()) == []


# ---- the CLI's checks of --out / -o ---------------------------------------------------------------

@pytest.mark.parametrize("tail", ["/", "/."])
def test_an_output_ending_in_a_separator_is_refused(tmp_path, capsys, tail):
    arg = f"{tmp_path}/newdir{tail}"
    assert main(["logits", "--tokens", "1", "--out", arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k31c: error: --out {arg} ends in ") and "give a file name" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_empty_output_is_refused(capsys):
    assert main(["logits", "--tokens", "1", "--out", ""]) == 2
    assert capsys.readouterr().err == "k31c: error: --out is empty: give a file name\n"


def test_a_symlink_output_is_checked_as_its_target(tmp_path):
    link = tmp_path / "lnk.npy"
    link.symlink_to(tmp_path / "no" / "such" / "x.npy")
    with pytest.raises(UsageError, match=f"directory {tmp_path}/no/such does not exist"):
        output_file(str(link), "--out")
    (tmp_path / "adir").mkdir()
    (tmp_path / "dlink").symlink_to("adir")
    with pytest.raises(UsageError, match="is a directory"):
        output_file(str(tmp_path / "dlink"), "--out")


# ---- init --out -----------------------------------------------------------------------------------

def test_init_out_in_a_directory_that_may_not_be_written(tmp_path, monkeypatch, capsys, no_init):
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != ro and real_access(p, mode, **k))
    assert main(["init", "--out", str(ro / "new" / "ckpt")]) == 2
    assert capsys.readouterr().err == (f"k31c: error: --out {ro}/new/ckpt: directory {ro} is not "
                                       "writable\n")


def test_init_out_empty_and_symlink_named_as_given(tmp_path, capsys, no_init):
    assert main(["init", "--out", ""]) == 2
    assert capsys.readouterr().err == "k31c: error: --out is empty: give the directory to write\n"
    (tmp_path / "real").mkdir()
    (tmp_path / "cklink").symlink_to("real")
    assert main(["init", "--out", str(tmp_path / "cklink"), "--force"]) == 2
    err = capsys.readouterr().err
    assert err == (f"k31c: error: --out {tmp_path}/cklink is a symbolic link (to real): give the "
                   "directory itself\n")


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A checkpoint or a kernel build is made beside its place and moved in, which cannot cross
    file systems: a mount point as --out is refused up front, naming the way out."""
    from k31c.checkpoint_files import replace_problem
    from k31c.lowering import aot_dir
    mount = tmp_path / "mnt"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real(p))
    assert "is a mount point" in replace_problem(mount, True, "--force")
    with pytest.raises(UsageError, match="is a mount point.*give a directory inside it"):
        aot_dir.check_out_dir(mount, "h200")
    assert replace_problem(mount / "ckpt", True, "--force") is None     # inside it: fine
    assert os.listdir(mount) == []
