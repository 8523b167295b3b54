"""k31c: an inference compiler for the Kimi K3.1 Pro architecture.

Re-exports the public names. The config names are plain Python; the rest import torch and the op
set, so they are loaded on first use (`k31c.load_checkpoint` etc.): importing any k31c module
stays cheap and never pulls in an optional backend.
"""
from importlib import import_module

from . import dynamo_registry as _dynamo_registry
from .config import PRESETS, ConfigError, K31Config, preset

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_LAZY = {
    "CheckpointError": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint_save",
    "init_checkpoint": ".checkpoint_save",
    "default_checkpoint": ".checkpoint_save",
    "ByteTokenizer": ".tokenizer",
    "K31ForCausalLM": ".graph.model",
    "Engine": ".runtime.engine",
    "compile": ".api",
    "CompiledModel": ".api",
}

__all__ = ["PRESETS", "ConfigError", "K31Config", "preset", "__version__", *_LAZY]


def dynamo_backend(gm, example_inputs):
    """The Dynamo backend `torch.compile(model, backend="k31c")`: the k31c passes on Dynamo's
    graph (k31c.backend). It loads k31c.backend on first use, so importing k31c stays cheap."""
    from .backend import dynamo_backend as backend
    return backend(gm, example_inputs)


_dynamo_registry.register(dynamo_backend)




def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
