"""Hand-written Triton kernels, registered for every target in `targets.GPU_TARGETS`.

Each kernel module holds one kernel family: the @triton.jit kernel(s) and a launcher with the k31c
op's exact signature, registered with lowering.registry. `register_all()` imports them (the
registry calls it the first time a GPU target's kernels are asked for); the shared leaf modules
(device, kda_common, mla_common, cache_write's FP8 helpers) register nothing.
"""
import importlib

from . import interpreter_fix

interpreter_fix.install()       # Triton 3.6's interpreter under NumPy >= 2.4

KERNEL_MODULES = ("cache_write", "indexer", "topk", "indexer_topk",
                  "mla", "mla_dense", "mla_dense_ws", "mla_two_pass", "mla_sparse_ws",
                  "linear_group", "attn_res",
                  "kda_decode", "kda_prefill", "moe_route", "moe_experts")


def register_all() -> None:
    for name in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{name}")
