"""Hand-written Triton kernels, registered for `h200` (and `mi350x` where portable).

Each module holds one kernel family: the @triton.jit kernel(s) and a launcher with the k31c op's
exact signature, registered with lowering.registry. Importing this package registers them all.
"""
import importlib

_MODULES = ("cache_write", "indexer", "topk", "indexer_topk", "mla", "mla_two_pass", "kda_decode", "kda_prefill")

for _m in _MODULES:
    importlib.import_module(f"{__name__}.{_m}")
