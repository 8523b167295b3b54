"""The gather of the warp-specialized sparse MLA kernel (mla_sparse_ws.py): its producer turns a
row's selected positions into cache rows (block table) and fills the seesaw's 32-key buffers
(mla_seesaw.seesaw_buffers: [32, 512] values + [32, 64] rope) with 16-byte cp.async, the
fill signalled by the copies' own arrivals on `ready`. The lookups run ahead of the copies
(positions two blocks early, the block table one), so a copy's address never waits on a
dependent pair of global loads. A -1 position and the tail past the keys are zero-filled.

- A bf16 cache of 576-wide rows goes straight into the buffers.
- FP8 latent rows (graph/ops/fp8_layouts.py: 512 e4m3, 4 fp32 scales, 64 bf16 rope; 656 bytes):
  the e4m3 bytes go into the upper half of the block's own value buffer (16 KB of its 32 KB;
  shared memory has no room for a staging area beside q and four buffers), the scales into a
  buffer of their own, the rope straight to its buffer. The math group that scores the block
  dequantises it in place once it lands (`dequant_block`: e4m3 x its row's scale in f16, the
  value buffers then being f16, `mla_seesaw.dequant_e4m3`); a zero-filled row's zero scale gives
  zero values. The dequant is what FP8 rows cost over bf16 rows; where else it could run, and
  what that measured: BENCHMARKS.md, "Sparse MLA on FP8 latent rows" and "FP8 latent rows in
  f16".
"""
from __future__ import annotations

from k31c.lowering.triton.gluon_sm90 import GLUON_ERROR

if GLUON_ERROR is None:
    from k31c.lowering.triton.gluon_sm90 import (async_copy, fence_async_shared, gl, gluon, mbarrier,
                                                 sync)
    from k31c.lowering.triton import mla_seesaw
    from k31c.lowering.triton.mla_seesaw import BK, DEQUANT_L, DV, NB, dequant_e4m3

    FP8_ROW = gl.constexpr(mla_seesaw.FP8_ROW)   # an FP8 latent row: 512 e4m3, 4 fp32 scales, 64 bf16
    SCALE_AT = gl.constexpr(DV // 4)             # the row's first scale, in fp32 units (byte 512)
    ROPE_AT = gl.constexpr((DV + 16) // 2)       # its rope, in bf16 units (byte 528)
    E4M3_L = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))   # [32, 128] bytes

    @gluon.jit
    def _positions(idx_row, n_keys, j, rows):
        # the selected positions of block j (-1 past the keys)
        return gl.load(idx_row + j * BK + rows, mask=j * BK + rows < n_keys, other=-1)

    @gluon.jit
    def _cache_rows(pos, blk, block_size):
        at = gl.maximum(pos, 0)
        return gl.maximum(blk, 0).to(gl.int64) * block_size + at % block_size

    @gluon.jit
    def _copy_bf16(cache_ptr, pos, blk, block_size, b, kv_bufs, kr_bufs, ready, empty, phase):
        # one block's 576-wide bf16 rows straight into buffer b, once it is free
        G_L: gl.constexpr = pos.type.layout.parent                 # [32, 64] bf16, 16 B a thread
        row = _cache_rows(pos, blk, block_size)
        cols = gl.max_contiguous(gl.multiple_of(gl.arange(0, 64, gl.SliceLayout(0, G_L)), 8), 8)
        ok = gl.expand_dims(pos >= 0, 1) & gl.expand_dims(cols >= 0, 0)
        src = cache_ptr + gl.expand_dims(gl.multiple_of(row * 576, 64), 1) + gl.expand_dims(cols, 0)
        mbarrier.wait(empty.index(b), phase)
        async_copy.async_copy_global_to_shared(kr_bufs.index(b), src + 512, mask=ok)
        for c in gl.static_range(8):
            async_copy.async_copy_global_to_shared(kv_bufs.index(b).slice(64 * c, 64, dim=1),
                                                   src + 64 * c, mask=ok)
        async_copy.mbarrier_arrive(ready.index(b), increment_count=False)

    @gluon.jit
    def fp8_scales():
        """FP8 rows' scales: each buffer's 32 rows of 4 (fp32)."""
        return gl.allocate_shared_memory(gl.float32, [NB, BK, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _copy_fp8(cache_ptr, scale_ptr, rope_ptr, pos, blk, block_size, b, kv_bufs, kr_bufs,
                  scl_bufs, ready, empty, phase):
        # one block's rows, once buffer b is free: e4m3 bytes to its staging half (four
        # [32, 128] column groups at views 8b + 4 .. 8b + 7), scales and rope to their buffers
        C_L: gl.constexpr = E4M3_L
        R_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])     # [32, 64] bf16
        F_L: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])     # [32, 4] fp32
        stage = staging(kv_bufs)
        row = _cache_rows(pos, blk, block_size)
        cols = gl.max_contiguous(gl.multiple_of(gl.arange(0, 128, gl.SliceLayout(0, C_L)), 16), 16)
        ok = gl.expand_dims(pos >= 0, 1) & gl.expand_dims(cols >= 0, 0)
        src = cache_ptr + gl.expand_dims(gl.multiple_of(row * FP8_ROW, 16), 1) + gl.expand_dims(cols, 0)
        mbarrier.wait(empty.index(b), phase)
        for g in gl.static_range(4):
            async_copy.async_copy_global_to_shared(stage.index(8 * b + 4 + g), src + 128 * g, mask=ok)
        row_r = gl.convert_layout(row, gl.SliceLayout(1, R_L))
        ok_r = gl.convert_layout(pos, gl.SliceLayout(1, R_L)) >= 0
        cols_r = gl.max_contiguous(gl.multiple_of(gl.arange(0, 64, gl.SliceLayout(0, R_L)), 8), 8)
        src_r = (rope_ptr + gl.expand_dims(gl.multiple_of(row_r * (FP8_ROW // 2) + ROPE_AT, 8), 1)
                 + gl.expand_dims(cols_r, 0))
        async_copy.async_copy_global_to_shared(kr_bufs.index(b), src_r,
                                               mask=gl.expand_dims(ok_r, 1) & gl.expand_dims(cols_r >= 0, 0))
        row_f = gl.convert_layout(row, gl.SliceLayout(1, F_L))
        ok_f = gl.convert_layout(pos, gl.SliceLayout(1, F_L)) >= 0
        cols_f = gl.arange(0, 4, gl.SliceLayout(0, F_L))
        src_f = scale_ptr + gl.expand_dims(row_f * (FP8_ROW // 4) + SCALE_AT, 1) + gl.expand_dims(cols_f, 0)
        async_copy.async_copy_global_to_shared(scl_bufs.index(b), src_f,
                                               mask=gl.expand_dims(ok_f, 1) & gl.expand_dims(cols_f >= 0, 0))
        async_copy.mbarrier_arrive(ready.index(b), increment_count=False)

    @gluon.jit
    def staging(kv_bufs):
        """The value buffers as [32, 128]-byte views: buffer b's staged e4m3 column groups are
        views 8b + 4 .. 8b + 7 (its upper 16 KB)."""
        return kv_bufs._reinterpret(gl.uint8, [NB * 8, BK, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def dequant_block(b, kv_bufs, scl_bufs):
        """Buffer b's staged e4m3 columns to f16 in place, by one warp group, fenced and synced
        for its wgmmas: column groups 0 and 1 write the lower half (nothing staged there); 2 and
        3 overwrite the staging, so every thread reads all four before the barrier and writes
        those two after it."""
        C_L: gl.constexpr = DEQUANT_L
        stage = staging(kv_bufs)
        kv = kv_bufs.index(b)
        scl = scl_bufs.index(b)
        x0 = stage.index(8 * b + 4).load(C_L)       # all four loads first: one latency
        x1 = stage.index(8 * b + 5).load(C_L)
        x2 = stage.index(8 * b + 6).load(C_L)
        x3 = stage.index(8 * b + 7).load(C_L)
        kv.slice(0, 128, dim=1).store(dequant_e4m3(x0, scl, 0, C_L, kv.dtype))
        kv.slice(128, 128, dim=1).store(dequant_e4m3(x1, scl, 1, C_L, kv.dtype))
        sync()
        kv.slice(256, 128, dim=1).store(dequant_e4m3(x2, scl, 2, C_L, kv.dtype))
        kv.slice(384, 128, dim=1).store(dequant_e4m3(x3, scl, 3, C_L, kv.dtype))
        fence_async_shared()            # the stores, before the wgmmas read them
        sync()

    @gluon.jit
    def gather(cache_ptr, scale_ptr, rope_ptr, table_row, idx_row, n_keys, block_size, kv_bufs,
               kr_bufs, scl_bufs, ready, empty, n_steps, FP8: gl.constexpr):
        """The producer: block i into buffer i % NB once both math groups are done with it, the
        copies arriving on `ready` (one arrival a producer thread). FP8: cache_ptr, scale_ptr
        and rope_ptr are uint8, fp32 and bf16 views of FP8 latent rows (else each the bf16
        cache), and each math group dequantises its block (`dequant_block`) once it lands."""
        if FP8:
            L: gl.constexpr = E4M3_L
        else:
            L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, BK, gl.SliceLayout(1, L))
        pos = _positions(idx_row, n_keys, 0, rows)
        pos_n = _positions(idx_row, n_keys, 1, rows)
        blk = gl.load(table_row + gl.maximum(pos, 0) // block_size, mask=pos >= 0, other=0)
        for i in range(n_steps):
            b = i % NB
            pos_nn = _positions(idx_row, n_keys, i + 2, rows)
            blk_n = gl.load(table_row + gl.maximum(pos_n, 0) // block_size, mask=pos_n >= 0,
                            other=0)
            phase = ((i // NB) & 1) ^ 1          # of `empty`: both groups done with the buffer
            if FP8:
                _copy_fp8(cache_ptr, scale_ptr, rope_ptr, pos, blk, block_size, b, kv_bufs, kr_bufs,
                          scl_bufs, ready, empty, phase)
            else:
                _copy_bf16(cache_ptr, pos, blk, block_size, b, kv_bufs, kr_bufs, ready, empty, phase)
            pos, blk, pos_n = pos_n, blk_n, pos_nn
