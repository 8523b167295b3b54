"""The k31c error hierarchy: what went wrong decides how the CLI reports it.

- `InputError` (and its kinds `ConfigError`, `CheckpointError`, `UsageError`): the user's input is
  wrong. The CLI prints one `k31c: error:` line (plus the list of problems) and exits 2.
- `CompilerError` (`GraphVerificationError`, `KernelBindError`, `ArtifactError`): k31c itself produced something
  wrong. The CLI says it is a k31c bug and exits 1.
- `RuntimeFailure`: running a program failed for a reason outside the input (no device, a pool
  exhausted). Exits 1.
They subclass ValueError / RuntimeError, so `except ValueError` also catches input errors.
"""
from __future__ import annotations


class K31cError(Exception):
    """Base of every error k31c raises on purpose."""


class InputError(K31cError, ValueError):
    """Bad input: a value, file or argument the user gave."""


class UsageError(InputError):
    """A call or command line that asks for something k31c does not offer."""


class CompilerError(K31cError, RuntimeError):
    """k31c produced a wrong graph or program: a bug to report, not a usage error."""


class GraphVerificationError(CompilerError, ValueError):
    """`verify` found a graph that breaks an invariant (shapes, stream order, single writers)."""


class KernelBindError(CompilerError):
    """A lowered program could not bind or build one of its kernels or dense pieces."""


class ArtifactError(KernelBindError):
    """Inductor could not build a dense piece (or graph) as a standalone artifact, the form the
    compile cache stores; the program is then built without the cache."""


class RuntimeFailure(K31cError, RuntimeError):
    """Running a built program failed (no device, resources exhausted)."""
