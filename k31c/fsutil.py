"""Writing files and directories so that a crash or a kill never leaves a partial result behind.

- `write_atomic(path, write)`: a file written through a temporary file in the same directory and
  renamed into place, with the mode the user's umask gives (a temporary file is created 0600).
- `temporary_dir(parent, name)`: a hidden working directory beside its final place, removed when
  the block ends however it ends (an exception, KeyboardInterrupt, or `Terminated` from the
  SIGTERM handler that `terminate_on_sigterm` installs).
- `clean_stale(parent, name)`: temporaries that a killed process (SIGKILL: no cleanup ran) left
  beside `name`. Every temporary carries its creator's pid, so only those of dead processes go.

`pause_point(name)` is the hook of the kill tests: with `K31C_PAUSE_AT=name` in the environment
the process stops itself (SIGSTOP) there, so a test kills it at exactly that point.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

# .<name>.tmp-<pid>-<random>  (a directory or a file being written)
# .<name>.old-<pid>-<random>  (a checkpoint being replaced: holds the previous one as "ckpt")
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

    A `.old-` directory whose process died between moving the previous checkpoint aside and
    moving the new one in is put back in place when `name` is missing, not deleted."""
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
        target = parent / name
        if m["kind"] == "old" and (path / "ckpt").is_dir() and not target.exists():
            os.rename(path / "ckpt", target)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextmanager
def temporary_dir(parent: Path, name: str, kind: str = "tmp") -> Iterator[Path]:
    """A fresh hidden directory in `parent` for building `parent/name`; removed when the block ends
    (what the block renamed out of it is kept)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=_prefix(name, kind)))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(f)` on a temporary file beside `path`, then rename it to `path`.

    The file gets mode 0666 minus the umask, as `open()` would give. On any failure (or a kill
    handled by `terminate_on_sigterm`) the temporary file is removed and `path` is unchanged."""
    path = Path(path)
    clean_stale(path.parent, path.name)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path.name, "tmp"), suffix=".tmp")
    except OSError as e:  # name the file the user asked for, not our temporary
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
