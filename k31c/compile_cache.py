"""The persistent compile cache: one directory per built step program (DESIGN §6).

An entry is named `<step>-<key>`, where the key hashes every factor the program depends on
(`factors`, given by the compiler: versions, target, options, passes, the k31c sources, the
config, the weights' shapes and dtypes, the step kind and the cache pool's geometry). The factors
are written in clear text to the entry's `manifest.json`, so a miss is explained by the factors
in which the nearest entry differs (`nearest`). The manifest also lists every file of the entry
with its size and SHA-256: an entry whose files do not match is damaged, reported, and rebuilt,
never loaded.

Writes never leave a partial entry: an entry is built in a hidden temporary directory beside
its final place and renamed into place with its manifest written last; builders of one key are
serialized by a lock file (`.locks/<name>.lock`), so a second one waits and then finds the entry.
What is inside an entry besides the manifest (the artifacts) is the compiler's business.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .fsutil import clean_stale, dir_mode, temporary_dir, write_atomic

MANIFEST = "manifest.json"
FORMAT = 1                      # the manifest's layout; another value is a different cache


def key_of(factors: dict) -> str:
    """The hash of the factors (canonical JSON): 20 hex digits."""
    text = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _listing(root: Path) -> dict[str, list]:
    """relative path -> [size, sha256] of every regular file under `root` but the manifest and
    lock files (Inductor takes locks inside its cache directory when it loads)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != MANIFEST and not path.name.endswith(".lock"):
            out[path.relative_to(root).as_posix()] = [path.stat().st_size, file_digest(path)]
    return out


@dataclass
class Entry:
    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def step(self) -> str:
        return self.manifest["factors"].get("step", "?")

    def size(self) -> int:
        return sum(size for size, _ in self.manifest["files"].values())


class Damaged(Exception):
    """An entry whose manifest or files are not what was written (the message says which)."""


class Unwritable(Exception):
    """The cache directory cannot take a new entry (the message says why)."""


class CompileCache:
    def __init__(self, root: Path):
        self.root = Path(root).expanduser()

    def name(self, step: str, factors: dict) -> str:
        return f"{step}-{key_of({'format': FORMAT, **factors})}"

    # ---- reading -----------------------------------------------------------------------------------
    def lookup(self, name: str) -> Optional[Entry]:
        """The entry `name`, checked whole; None when there is none. Raises Damaged."""
        path = self.root / name
        if not path.is_dir():
            return None
        return self.check(path)

    def check(self, path: Path) -> Entry:
        """The entry at `path` with its files checked against its manifest (raises Damaged)."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            files, version = manifest["files"], manifest["format"]
        except FileNotFoundError:
            raise Damaged(f"{path.name}: no {MANIFEST}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise Damaged(f"{path.name}: unreadable {MANIFEST} ({type(e).__name__})") from None
        if version != FORMAT:
            raise Damaged(f"{path.name}: manifest format {version}, this k31c writes {FORMAT}")
        for rel, (size, digest) in files.items():
            f = path / rel
            if not f.is_file():
                raise Damaged(f"{path.name}: {rel} is missing")
            if f.stat().st_size != size:
                raise Damaged(f"{path.name}: {rel} has {f.stat().st_size} bytes, the manifest says {size}")
            if file_digest(f) != digest:
                raise Damaged(f"{path.name}: {rel} does not match its SHA-256 in the manifest")
        return Entry(path, manifest)

    def entries(self) -> list[tuple[Path, Optional[Entry], Optional[str]]]:
        """(path, entry or None, problem or None) of every entry directory, by name."""
        out = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.iterdir()):
            if not path.is_dir() or path.name.startswith("."):
                continue
            try:
                out.append((path, self.check(path), None))
            except Damaged as e:
                out.append((path, None, str(e)))
        return out

    def nearest(self, step: str, factors: dict) -> Optional[tuple[str, list[str]]]:
        """(entry name, the factors it differs in) of the readable entry of the same step kind
        that differs from `factors` in the fewest top-level factors; source files are named."""
        best = None
        if not self.root.is_dir():
            return None
        factors = json.loads(json.dumps(factors, default=str))     # as a manifest holds them
        for path in self.root.glob(f"{step}-*"):
            try:
                theirs = json.loads((path / MANIFEST).read_text())["factors"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            diff = [k for k in sorted(set(factors) | set(theirs)) if factors.get(k) != theirs.get(k)]
            if "source" in diff and isinstance(factors.get("source"), dict) and isinstance(theirs.get("source"), dict):
                a, b = factors["source"], theirs["source"]
                files = [f for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
                diff[diff.index("source")] = "source (" + ", ".join(files[:4]) + (", ..." if len(files) > 4 else "") + ")"
            if best is None or len(diff) < len(best[1]):
                best = (path.name, diff)
        return best

    # ---- writing -----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the cache directory if needed; Unwritable if it cannot take entries."""
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=dir_mode())
            (self.root / ".locks").mkdir(exist_ok=True, mode=dir_mode())
        except OSError as e:
            raise Unwritable(f"{self.root}: cannot create it ({e.strerror})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise Unwritable(f"{self.root}: not writable")

    @contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold the builders' lock of entry `name` (another process building it waits here)."""
        self.prepare()
        with open(self.root / ".locks" / f"{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @contextmanager
    def building(self, name: str) -> Iterator[Path]:
        """A temporary directory to build entry `name` in (call under `locked(name)`); `publish`
        renames it into place. Left unpublished, it is removed."""
        clean_stale(self.root, name)
        with temporary_dir(self.root, name) as tmp:
            yield tmp

    def publish(self, tmp: Path, name: str, factors: dict, info: dict) -> Entry:
        """Write the manifest of the entry built in `tmp` (its files listed with their hashes)
        and rename it into place, replacing a damaged entry of that name."""
        manifest = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "factors": factors, "info": info, "files": _listing(tmp)}
        write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1, default=str).encode()))
        final = self.root / name
        if final.exists():
            self.remove(final)
        os.rename(tmp, final)
        return Entry(final, manifest)

    def remove(self, path: Path) -> None:
        """Delete an entry: renamed aside first, so no reader sees it half deleted."""
        with temporary_dir(self.root, path.name) as aside:
            os.rename(path, aside / "entry")
            shutil.rmtree(aside / "entry", ignore_errors=True)
