"""What a kernel module tells the ahead-of-time build (lowering/aot.py): the shapes its launch
plans are made for, and one `AotSpec` per launch its launchers make there.

A leaf below both the kernels (which list their launches in `aot_specs(shapes)`) and aot.py
(which imports the kernel modules only by name, through the registry).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

_PTR_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv",
              "uint8": "u8", "int32": "i32", "int64": "i64"}   # torch dtype name -> Triton type


def descriptor_type(dtype, block: tuple, layout=None) -> str:
    """The signature type of a TMA tensor descriptor of `dtype` (a torch dtype) with this block;
    a Gluon descriptor also names its shared-memory `layout` (an NVMMASharedLayout)."""
    block_type = f"{_PTR_TYPES[str(dtype).removeprefix('torch.')]}[{','.join(map(str, block))}]"
    return f"tensordesc<{block_type}>" if layout is None else f"tensordesc<{block_type},{layout}>"


@dataclass(frozen=True)
class AotShapes:
    """The shapes the launch plans are made for (K3.1 Pro serving) on one target."""
    cfg: object                            # K31Config (preset "k3.1-pro")
    target: object                         # targets.Target: SM count, backend, dot precision
    block_size: int = 64                   # paged cache block (latent and index planes)
    batch: int = 16                        # decode requests
    rows_per_request: tuple[int, ...] = (1, 4)   # plain decode, 4-row verification
    context: int = 131072                  # keys a row sees (indexer / top-k width)
    prefill_requests: int = 1              # requests in one KDA prefill launch
    prefill_tokens: int = 8192             # rows of one prefill step (a full chunked-prefill
                                           # step: the runtime's default max_prefill_tokens)


class AotSpec(NamedTuple):
    """One launch to build: what `kernel[grid](...)` compiles at run time."""
    kernel: object                         # the @triton.jit function
    signature: dict                        # arg name -> "*bf16", "i32", "fp32", "constexpr"
    constexprs: dict                       # constexpr arg name -> value
    num_warps: int
    num_stages: Optional[int]              # None: the backend's default (the launcher passes none)
    variant: str                           # what distinguishes this launch ("fp8,R=4")
    ops: tuple[str, ...]                   # the k31c ops whose launchers make it
    family: str = ""                       # the kernel module whose aot_specs() lists it
    ints: tuple[tuple[str, int], ...] = ()  # integer arguments' values at these shapes
    maxnreg: Optional[int] = None          # the launch's register cap (CUDA builds; None: none)

    @property
    def divisible(self) -> tuple[str, ...]:
        """The integer arguments the JIT would hint as multiples of 16 (1 is a constexpr)."""
        return tuple(n for n, v in self.ints if v != 1 and v % 16 == 0)

def kernel_spec(kernel, ops, variant: str, constexprs: dict, types: dict, num_warps: int = 4,
                num_stages: Optional[int] = None, ints: Optional[dict] = None,
                maxnreg: Optional[int] = None) -> AotSpec:
    """An AotSpec with the full signature: constexprs by name (a constexpr with a default, such as
    PDL, takes it unless given), pointers from `types` (a torch dtype per pointer argument: every
    `*_ptr` argument must be listed), other scalars from `types` as Triton type strings ("fp32",
    "i64"), "i32" when unlisted. `ints`: integer arguments' values at these shapes, specialized
    as the JIT specializes a launch (1 becomes a constexpr, a multiple of 16 gets the
    divisibility hint), so the build compiles what the launch would run; an integer not listed is
    built for any value, which can be different code (no vectorized or pipelined loads).
    `maxnreg`: the register cap the launcher passes on CUDA (device.register_cap), if any."""
    import torch  # lazily: `k31c --help` builds this command's parser without importing torch
    names = list(kernel.arg_names)
    unknown = (set(constexprs) | set(types)) - set(names)
    if unknown:
        raise ValueError(f"{kernel.__name__}: no arguments named {sorted(unknown)}")
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs
               and not p.has_default]
    if missing:
        raise ValueError(f"{kernel.__name__}: constexprs {missing} have no value")
    values = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    values.update(constexprs)
    ints = dict(ints or {})
    bad = [n for n in ints if n not in names or n in values or n.endswith("_ptr")
           or types.get(n, "i32") not in ("i32", "i64")]
    if bad:
        raise ValueError(f"{kernel.__name__}: ints {bad} are not integer arguments")
    values.update({n: 1 for n, v in ints.items() if v == 1})      # the JIT's specialization
    signature = {}
    for name in names:
        if name in values:
            signature[name] = "constexpr"
        elif isinstance(types.get(name), torch.dtype):
            signature[name] = "*" + _PTR_TYPES[str(types[name]).removeprefix("torch.")]
        elif name.endswith("_ptr"):
            raise ValueError(f"{kernel.__name__}: pointer argument '{name}' needs a dtype in types")
        else:
            signature[name] = types.get(name, "i32")
    return AotSpec(kernel, signature, values, num_warps, num_stages, variant,
                   tuple([ops] if isinstance(ops, str) else ops), ints=tuple(sorted(ints.items())),
                   maxnreg=maxnreg or None)
