"""The first node of a replayed decode step: its per-step inputs, staged by the host, into the
graph's static buffers.

The host writes a step's token ids and metadata into one buffer of 32-bit words: the dense part
(each input's bytes at a fixed offset) and then (index, value) pairs that update the static block
table in place (-1: no update), so a step ships only the block-table entries that changed. On CUDA
the kernel reads that buffer straight from pinned host memory (zero-copy over the bus: one small
kernel instead of a host-to-device copy, a copy into the static buffers and their launch gaps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _stage_kernel(src_ptr, dense_ptr, n_dense, table_ptr, n_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_dense
    tl.store(dense_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)
    p = offs < n_pairs
    idx = tl.load(src_ptr + n_dense + 2 * offs, mask=p, other=-1)
    val = tl.load(src_ptr + n_dense + 2 * offs + 1, mask=p)
    tl.store(table_ptr + idx, val, mask=p & (idx >= 0))


def stage_words(src: torch.Tensor, dense: torch.Tensor, table: torch.Tensor) -> None:
    """dense[:] = src[:len(dense)]; then table.view(-1)[i] = v for each pair (i, v) of
    src[len(dense):] viewed as [-1, 2] with i >= 0. All int32; src may be pinned host memory."""
    n_dense, rest = dense.numel(), src.numel() - dense.numel()
    for name, t in (("src", src), ("dense", dense), ("table", table)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"stage_words: {name} must be contiguous int32, got {t.dtype} "
                             f"strides {tuple(t.stride())}")
    if rest < 0 or rest % 2:
        raise ValueError(f"stage_words: src holds {src.numel()} words: {n_dense} dense and an odd "
                         "or negative number of pair words")
    n_pairs = rest // 2
    grid = (max(triton.cdiv(max(n_dense, n_pairs), BLOCK), 1),)
    _stage_kernel[grid](src, dense, n_dense, table, n_pairs, BLOCK=BLOCK)
