"""`k31c cache`: what the compile cache holds (`list`), removing what cannot be loaded any more
(`prune`), and emptying it (`clear`). Beside the entries it holds the k31c kernels' Triton
binaries (`.triton/`, runtime/kernel_store.py): listed, removed by `clear`, kept by `prune`
(Triton keys them itself, so one built by another Triton is never loaded, only kept)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .common import add_cache_dir


def add(sub) -> None:
    p = sub.add_parser("cache", help="list, prune or clear the compile cache",
                       description="list: every entry with its step, target, size and state (a "
                                   "damaged entry says why, and is rebuilt when next needed; a stale "
                                   "one was built by another k31c, torch or Python and is never "
                                   "loaded by this one), and the k31c kernels' Triton binaries. "
                                   "prune: remove the damaged and stale entries. clear: remove "
                                   "every entry and the Triton binaries.")
    p.add_argument("action", choices=("list", "prune", "clear"))
    add_cache_dir(p)
    p.set_defaults(run=run)


def _root(arg) -> Path:
    from ..cached_program import CACHE_ENV, cache_root
    root = cache_root(arg or None)
    if root is None:
        raise UsageError(f"${CACHE_ENV} turns the compile cache off; give --cache-dir")
    if root.exists() and not root.is_dir():
        raise UsageError(f"the compile cache {root} is not a directory")
    return root


def _kernels(n: int) -> str:
    return f"{n} Triton kernel" + ("" if n == 1 else "s")


def run(args) -> int:
    root = _root(args.cache_dir)
    try:
        return _act(args.action, root)
    except PermissionError as e:    # named as the cache it is, not as one of its files
        raise UsageError(f"cannot {args.action} the compile cache {root}: {e.strerror} ({e.filename})") from None


def _act(action: str, root: Path) -> int:
    from ..compile_cache import CompileCache
    cache = CompileCache(root)
    entries = cache.entries()
    from ..cached_program import stale
    from ..runtime import kernel_store
    store = root / kernel_store.STORE_DIR
    kernels, size = kernel_store.summary(store)
    if action != "list":
        gone = [path for path, entry, _ in entries
                if action == "clear" or entry is None or stale(entry.manifest["factors"])]
        for path in gone:
            cache.remove(path)
        also = ""
        if action == "clear" and store.is_dir():
            kernel_store.clear(store)
            also = f" and {_kernels(kernels)} ({size / 2**20:.1f} MiB)"
        print(f"removed {len(gone)} of {len(entries)} entries{also} from {root}")
        return 0
    print(f"compile cache {root}: {len(entries)} entries; {_kernels(kernels)} of k31c's "
          f"({size / 2**20:.1f} MiB)")
    for path, entry, problem in entries:
        if entry is None:
            print(f"  {path.name:34s} DAMAGED: {problem.split(': ', 1)[-1]}")
            continue
        f = entry.manifest["factors"]
        why = stale(f)
        print(f"  {path.name:34s} target={f.get('target')} torch={f.get('torch')} "
              f"{entry.size() / 2**20:6.1f} MiB  {entry.manifest.get('created', '?')}"
              + (f"  STALE: {why}" if why else ""))
    return 0
