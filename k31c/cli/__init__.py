"""The `k31c` command line: one module per subcommand, listed in COMMANDS.

Each subcommand module has `add(subparsers)`, which declares its arguments and sets `run`, and
imports torch only inside `run`, so `k31c --help` stays fast. How an error is reported follows
the k31c.errors hierarchy (README "Errors"):

- InputError (ConfigError, CheckpointError, UsageError), argparse's errors, and OS errors about
  the user's paths: one `k31c: error: ...` line (a config or checkpoint error adds its list of
  problems), exit 2;
- CompilerError: `k31c: internal error (a k31c bug): ...`, exit 1;
- RuntimeFailure, other OS errors (disk full, I/O) and running out of memory: `k31c: error: ...`,
  exit 1;
- Ctrl-C: `k31c: interrupted`, exit 130; SIGTERM: `k31c: terminated`, exit 143; temporaries are
  removed in both cases.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys
import threading
import traceback
from importlib import import_module
from typing import Optional

from .. import fsutil
from ..errors import CompilerError, InputError, K31cError
from .common import PROG, log

# subcommand -> module of this package
COMMANDS = {
    "init": "init",
    "logits": "logits",
    "generate": "generate",
    "info": "info",
    "inspect": "inspect",
    "build-kernels": "build_kernels",
    "prebuild": "prebuild",
    "cache": "cache",
    "bench": "bench",
}

# OS errors caused by the paths a user gave (exit 2); the others are the machine's (exit 1).
INPUT_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST,
                errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.ELOOP, errno.EROFS, errno.EBUSY,
                errno.EXDEV, errno.ENODEV}


class ArgumentError(Exception):
    """argparse's complaint about the command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="k31c: an inference compiler for the Kimi K3.1 Pro "
                                            "architecture.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS.values():
        import_module(f".{module}", __name__).add(sub)
    return parser


def _describe(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _out_of_memory(e: Exception) -> Optional[str]:
    """The one-line message of an allocation failure (MemoryError, or torch's allocators: a
    RuntimeError saying "can't allocate memory" / "out of memory"), else None."""
    if isinstance(e, MemoryError):
        return str(e)
    text = str(e).strip()
    if not isinstance(e, RuntimeError) or not re.search(r"can't allocate memory|out of memory", text,
                                                          re.IGNORECASE):
        return None
    first = text.splitlines()[0]
    return re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", first)   # c10's location prefix


def _run(args) -> int:
    try:
        return args.run(args)
    except InputError as e:
        log(f"error: {e}")
        return 2
    except CompilerError as e:
        log(f"internal error (a k31c bug): {e}")
        return 1
    except K31cError as e:
        log(f"error: {e}")
        return 1
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        log(f"error: {_describe(e)}")
        return 2 if e.errno in INPUT_ERRNOS else 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except fsutil.Terminated:
        log("terminated")
        return 143
    except Exception as e:
        oom = _out_of_memory(e)
        if oom is not None:   # the machine's limit, not a bug: no traceback
            log(f"error: out of memory{': ' + oom if oom else ''}")
            return 1
        # a bug: the traceback is what its report needs
        traceback.print_exc()
        log(f"internal error (a k31c bug): {type(e).__name__}: {e}")
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ArgumentError as e:
        log(f"error: {e}")
        return 2
    if not hasattr(args, "run"):
        log(f"error: no command given (`{PROG} --help` lists them)")
        return 2
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None
    if in_main:
        fsutil.terminate_on_sigterm()
    try:
        return _run(args)
    finally:
        if in_main and previous is not None:
            signal.signal(signal.SIGTERM, previous)
