"""Writing files and directories so that a crash or a kill never leaves a partial result behind.

- `write_atomic(path, write)`: a file written through a temporary file in the same directory and
  renamed into place, with the mode the user's umask gives (a temporary file is created 0600).
  A symbolic link is followed (its target is replaced, the link stays); a device or FIFO is
  written into, never replaced.
- `temporary_dir(parent, name)`: a hidden working directory beside its final place, removed when
  the block ends however it ends (an exception, KeyboardInterrupt, or `Terminated` from the
  SIGTERM handler that `terminate_on_sigterm` installs).
- `replace_dir(new, target)` / `replace_files(new, target, names)`: a directory put in the place of
  another (or, for one that cannot be renamed, its files), the previous contents kept aside in a
  `.old-` directory until the new ones are in; a failure or a kill leaves the old or the new whole.
- `clean_stale(parent, name)`: temporaries that a killed process (SIGKILL: no cleanup ran) left
  beside `name`. Every temporary carries its creator's pid, so only those of dead processes go;
  a replacement it stopped halfway is first finished or undone.

`pause_point(name)` is the hook of the kill tests: with `K31C_PAUSE_AT=name` in the environment
the process stops itself (SIGSTOP) there, so a test kills it at exactly that point.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

# .<name>.tmp-<pid>-<random>  (a directory or a file being written)
# .<name>.old-<pid>-<random>  (a directory being replaced: see _finish_replace)
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[^.]*(\.tmp)?$")


class Terminated(BaseException):
    """Raised by the SIGTERM handler, so that `finally` blocks clean up as for Ctrl-C."""


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into `Terminated` in the main thread (the CLI installs it; a library does not)."""
    def handler(signum, frame):
        raise Terminated()
    signal.signal(signal.SIGTERM, handler)


def pause_point(name: str) -> None:
    if os.environ.get("K31C_PAUSE_AT") == name:
        os.kill(os.getpid(), signal.SIGSTOP)


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


def _prefix(name: str, kind: str) -> str:
    return f".{name}.{kind}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale(parent: Path, name: str) -> list[Path]:
    """Remove the temporaries of dead processes beside `parent/name`; returns what was removed.

    A replacement of `name` that such a process stopped halfway (a `.old-` directory) is first
    finished or undone (_finish_replace), so that nothing of the previous contents is lost."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if not m or m["name"] != name or _alive(int(m["pid"])):
            continue
        path = Path(entry.path)
        if m["kind"] == "old" and path.is_dir() and not path.is_symlink():
            _finish_replace(path, parent / name)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def clean_stale_for_reader(path: Path) -> None:
    """clean_stale for a reader of `path`, so that it finds a replacement that a killed process
    stopped halfway finished or undone. A reader that may not write there leaves it to the next
    writer."""
    path = Path(os.path.abspath(path))
    try:
        clean_stale(path.parent, path.name)
    except OSError:
        pass


def left_aside(path: Path) -> list[Path]:
    """The `.old-` directories of replacements of `path` (live ones, or ones clean_stale could not
    finish): where the previous contents of `path` may be."""
    path = Path(os.path.abspath(path))
    try:
        names = sorted(os.listdir(path.parent))
    except OSError:
        return []
    return [path.parent / n for n in names
            if (m := _TEMP.match(n)) and m["name"] == path.name and m["kind"] == "old"]


# ---- replacing a directory ------------------------------------------------------------------------
# The `.old-` directory of a replacement holds:
#   ckpt/   the previous contents, complete (replace_dir: the directory itself; replace_files: its
#           files, and once it exists the new files may go in);
#   aside/  replace_files: the previous files being moved aside (renamed to ckpt/ when all are);
#   new/    replace_files: the new files not yet moved in.
# Each step is one rename, so whatever step a kill interrupts, _finish_replace finds a state it
# can bring to the complete old or the complete new contents.

def _move_all(src: Path, dst: Path) -> None:
    for name in sorted(os.listdir(src)):
        os.replace(src / name, dst / name)


def _finish_replace(old: Path, target: Path) -> None:
    """Bring a replacement of `target` that stopped halfway (its `.old-` directory `old`) to a whole
    state: the previous contents back, or the new ones complete."""
    if (old / "aside").is_dir():     # stopped moving the old files aside: move them back
        _move_all(old / "aside", target)
    elif (old / "ckpt").is_dir() and not os.path.lexists(target):   # between replace_dir's renames
        os.rename(old / "ckpt", target)
    elif (old / "ckpt").is_dir() and (old / "new").is_dir():        # moving the new files in: finish
        _move_all(old / "new", target)


@contextmanager
def _replacing(target: Path) -> Iterator[Path]:
    """The `.old-` directory of one replacement of `target`. On a failure (Ctrl-C and SIGTERM
    included) the replacement is brought to a whole state first; the directory is kept when that
    fails too, for the next clean_stale to retry, and removed otherwise."""
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=_prefix(target.name, "old")))
    try:
        yield old
    except BaseException:
        _finish_replace(old, target)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def replace_dir(new: Path, target: Path) -> None:
    """Put the directory `new` in the place of the directory `target` (same parent)."""
    with _replacing(target) as old:
        os.rename(target, old / "ckpt")
        pause_point("checkpoint-swap")
        os.rename(new, target)


def replace_files(new: Path, target: Path, names: list[str]) -> None:
    """Replace the files `names` of `target` by the files of the directory `new`, for a directory
    that cannot itself be renamed (the working directory). The old files go aside
    first, so a failure before all are aside puts them back and one after it finishes the move."""
    with _replacing(target) as old:
        os.rename(new, old / "new")
        (old / "aside").mkdir()
        for name in names:
            os.rename(target / name, old / "aside" / name)
        os.rename(old / "aside", old / "ckpt")   # from here on, finishing is the way to a whole state
        pause_point("checkpoint-swap")
        _move_all(old / "new", target)


@contextmanager
def temporary_dir(parent: Path, name: str, kind: str = "tmp") -> Iterator[Path]:
    """A fresh hidden directory in `parent` for building `parent/name`; removed when the block ends
    (what the block renamed out of it is kept)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=_prefix(name, kind)))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def naming(e: OSError, path: Path) -> OSError:
    """`e` reported against `path`, the output the user asked for, instead of one of our temporaries."""
    if e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))


def output_target(path: Path) -> Path:
    """The file that writing `path` changes: a symbolic link's target (the link stays a link)."""
    path = Path(path)
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if target.is_symlink():   # realpath stops inside a loop of links
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    return target


def is_special(path: Path) -> bool:
    """An existing file that is neither a regular file nor a directory (a device, a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def parent_problem(out: Path) -> str | None:
    """Why `out` cannot be created, or None: its nearest existing ancestor (the directory it
    would be made in) must be a directory the user may write."""
    parent = Path(os.path.abspath(out)).parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def mount_point_problem(out: Path, what: str) -> str | None:
    """Why the directory `out` cannot be replaced by `what`, made beside it and moved in: a mount
    point, whose parent is another file system. None otherwise."""
    if os.path.ismount(out):
        return (f"is a mount point: {what} is written beside its place and moved in, which cannot "
                "cross file systems; give a directory inside it")
    return None


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(f)` on a temporary file beside `path`, then rename it to `path`.

    The file gets mode 0666 minus the umask, as `open()` would give. On any failure (or a kill
    handled by `terminate_on_sigterm`) the temporary file is removed and `path` is unchanged.
    A symbolic link `path` has its target replaced; a device or FIFO (/dev/null) is written
    into, since renaming over it would replace the device by a regular file."""
    path = output_target(path)
    if is_special(path):
        with open(path, "wb") as f:
            write(f)
        return
    clean_stale(path.parent, path.name)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path.name, "tmp"), suffix=".tmp")
    except OSError as e:
        raise naming(e, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise naming(e, path) from None
        raise
