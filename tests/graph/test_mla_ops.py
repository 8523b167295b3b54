"""MLA cache writes, lightning indexer, top-k and sparse/dense MLA ops against naive oracles."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import k31c.graph.ops  # noqa: F401
from k31c.graph.ops.cache_write import (gather_index_keys, gather_latent_rows, index_row_bytes,
                                        quantize_index_fp8)

ops = torch.ops.k31c


def paged_requests(lengths, block_size, gen, spare_blocks=3):
    """A shuffled block pool shared by the requests: block_table [B, max_blocks] int32 (-1 unused)."""
    need = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1
    table = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table, num_blocks


def slots_for(table, b, positions, block_size):
    return torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size for p in positions],
                        dtype=torch.int64)


def decode_fp8_token(cache, slot, block_size, d):
    """Independent reading of spec §6.5: one token's key from the raw bytes of its block."""
    block, off = divmod(slot, block_size)
    raw = bytes(cache[block].tolist())
    n_scales = -(-d // 128)
    vals = torch.tensor(list(raw[off * d:(off + 1) * d]), dtype=torch.uint8).view(torch.float8_e4m3fn)
    base = block_size * d + off * 4 * n_scales
    scales = struct.unpack(f"<{n_scales}f", raw[base:base + 4 * n_scales])
    return torch.stack([vals[i].float() * scales[i // 128] for i in range(d)])


# ---- cache writes ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write_places_rows_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(5, 4, 12, generator=gen).to(dtype)
    before = cache.clone()
    rows = torch.randn(6, 12, generator=gen)
    slots = torch.tensor([7, 0, 19, 3, -1, 12])
    ops.mla_cache_write(cache, rows, slots)
    flat, old = cache.view(-1, 12), before.view(-1, 12)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], rows[i].to(dtype))
    untouched = [s for s in range(20) if s not in slots.tolist()]
    assert torch.equal(flat[untouched], old[untouched])
    table = torch.tensor([1, 4, 0], dtype=torch.int32)          # logical blocks of one request
    got = gather_latent_rows(cache, table, 9)
    expect = torch.stack([cache[table[p // 4], p % 4] for p in range(9)])
    assert torch.equal(got, expect)


@pytest.mark.parametrize("d", [32, 256])
def test_index_fp8_layout_matches_spec_bytes(d):
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks = 4, 3
    cache = torch.randint(0, 255, (num_blocks, block_size * index_row_bytes(d)), generator=gen,
                          dtype=torch.uint8)
    keys = torch.randn(block_size, d, generator=gen) * 3
    keys[2] = torch.randn(d, generator=gen) * 1e-7               # exercises the 1e-4 amax floor
    order = torch.randperm(block_size, generator=gen)
    slots = (block_size * 1 + order).long()                      # fill block 1 in shuffled order
    other = cache[[0, 2]].clone()
    ops.index_cache_write(cache, keys, slots)

    n_scales = -(-d // 128)
    value_bytes, scale_bytes = b"", b""
    for off in range(block_size):
        key = keys[(order == off).nonzero().item()]
        scales = []
        for g in range(n_scales):
            part = key[g * 128:(g + 1) * 128]
            scale = np.float32(max(np.float32(part.abs().max()), np.float32(1e-4))) / np.float32(448)
            scales.append(float(scale))
            q = (part / torch.tensor(scale, dtype=torch.float32)).to(torch.float8_e4m3fn)
            value_bytes += bytes(q.view(torch.uint8).tolist())
        scale_bytes += struct.pack(f"<{n_scales}f", *scales)
    assert bytes(cache[1].tolist()) == value_bytes + scale_bytes
    assert torch.equal(cache[[0, 2]], other)                     # other blocks untouched


@pytest.mark.parametrize("d", [32, 256])
def test_index_fp8_round_trip_within_fp8_error(d):
    gen = torch.Generator().manual_seed(2)
    block_size = 8
    cache = torch.zeros(4, block_size * index_row_bytes(d), dtype=torch.uint8)
    keys = torch.randn(20, d, generator=gen) * torch.rand(20, 1, generator=gen) * 5
    table = torch.tensor([2, 0, 3], dtype=torch.int32)
    ops.index_cache_write(cache, keys, slots_for(table[None], 0, range(20), block_size))
    got = gather_index_keys(cache, table, 20, block_size)
    values, scales = quantize_index_fp8(keys)
    per_value_scale = scales.repeat_interleave(128, 1)[:, :d]
    # e4m3: 3 mantissa bits (rel. error ≤ 2^-4), subnormal step 2^-9 in scaled units
    bound = keys.abs() * 2 ** -4 + per_value_scale * 2 ** -9
    assert ((got - keys).abs() <= bound + 1e-7).all()
    assert (got != keys).any()                                   # it really is quantised
    for p in (0, 9, 19):
        slot = int(table[p // block_size]) * block_size + p % block_size
        assert torch.allclose(got[p], decode_fp8_token(cache, slot, block_size, d), rtol=0, atol=0)


def _mx_exponent(amax: float) -> int:
    """The smallest e in [-126, 127] with 448 * 2^e >= amax (spec: ceil(log2(amax / 448)), clamped)."""
    e = -126
    while e < 127 and 448.0 * 2.0 ** e < amax:
        e += 1
    return e


@pytest.mark.parametrize("d", [32, 128])
def test_index_mxfp8_layout_matches_spec_bytes(d):
    """The MXFP8 index cache byte by byte (OCP microscaling, fp8_layouts.py): per block the e4m3
    values token-major, then one E8M0 byte (e + 127) per 32 values token-major."""
    gen = torch.Generator().manual_seed(4)
    block_size, num_blocks, groups = 4, 3, d // 32
    row = d + groups
    cache = torch.randint(0, 255, (num_blocks, block_size * row), generator=gen, dtype=torch.uint8)
    keys = torch.randn(block_size, d, generator=gen) * torch.rand(block_size, 1, generator=gen) * 20
    keys[1, :32] = keys[1, :32] / keys[1, :32].abs().max() * 896     # amax / 448 = 2^1 exactly: e = 1
    keys[2, :32] = torch.randn(32, generator=gen) * 1e-40             # subnormal amax: e clamps to -126
    order = torch.randperm(block_size, generator=gen)
    slots = (block_size * 2 + order).long()                           # fill block 2 in shuffled order
    other = cache[:2].clone()
    mx = cache.view(torch.float8_e4m3fn)
    ops.index_cache_write(mx, keys, slots)

    value_bytes, scale_bytes = b"", b""
    for off in range(block_size):
        key = keys[(order == off).nonzero().item()]
        for g in range(groups):
            part = key[g * 32:(g + 1) * 32]
            e = _mx_exponent(float(part.abs().max()))
            q = (part.double() / 2.0 ** e).float().to(torch.float8_e4m3fn)
            value_bytes += bytes(q.view(torch.uint8).tolist())
            scale_bytes += bytes([e + 127])
    assert bytes(cache[2].tolist()) == value_bytes + scale_bytes
    assert scale_bytes[int(order[1]) * groups] == 1 + 127                # the exact power of two
    assert scale_bytes[int(order[2]) * groups] == -126 + 127             # the clamped exponent
    assert torch.equal(cache[:2], other)                               # other blocks untouched

    # read back through the pool's reader: each value times its group's 2^e, as decoded here
    table = torch.tensor([2], dtype=torch.int32)
    got = gather_index_keys(mx, table, block_size, block_size)
    for p in range(block_size):
        vals = torch.tensor(list(value_bytes[p * d:(p + 1) * d]), dtype=torch.uint8)
        exps = torch.tensor(list(scale_bytes[p * groups:(p + 1) * groups])).double() - 127
        want = vals.view(torch.float8_e4m3fn).double() * (2.0 ** exps).repeat_interleave(32)
        assert torch.equal(got[p].double(), want), p
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative, or one subnormal step (2^-9 * 2^e)
    key_of = keys[order.argsort()]
    step = (2.0 ** (torch.tensor(list(scale_bytes)).double() - 127 - 9)).view(block_size, groups)
    assert ((got.double() - key_of.double()).abs()
            <= key_of.double().abs() * 2 ** -4 + step.repeat_interleave(32, 1)).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_index_key_norm_write_equals_layernorm_then_write(cache_dtype):
    gen = torch.Generator().manual_seed(3)
    d, block_size, n = 32, 4, 7
    k_pre = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    w, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    slots = torch.randperm(12, generator=gen)[:n]
    shape = (3, block_size * index_row_bytes(d)) if cache_dtype == torch.uint8 else (3, block_size, d)
    fused, unfused = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    ops.index_key_norm_write(fused, k_pre, w, b, slots, 1e-6)
    ops.index_cache_write(unfused, F.layer_norm(k_pre.float(), (d,), w, b, 1e-6), slots)
    assert torch.equal(fused, unfused)
    # independent oracle: LayerNorm written out by hand in float64, then read back from the cache
    # (the FP8 layout decoded byte by byte, as spec §6.5 describes it)
    x = k_pre.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    expect = ((x - mean) / torch.sqrt(var + 1e-6) * w.double() + b.double()).float()
    written = fused.view(-1, d)[slots].float() if cache_dtype != torch.uint8 else torch.stack(
        [decode_fp8_token(fused, int(s), block_size, d) for s in slots])
    if cache_dtype == torch.float32:
        bound = 1e-5 * (1 + expect.abs())
    elif cache_dtype == torch.bfloat16:
        bound = expect.abs() * 2 ** -8 + 1e-5                           # bf16: 8 significant bits
    else:                                    # e4m3: 3 mantissa bits; one scale per 128 values
        scale = expect.abs().amax(-1, keepdim=True) / 448
        bound = expect.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-6
    assert ((written - expect).abs() <= bound).all()


# ---- indexer --------------------------------------------------------------------------------------

def naive_indexer(q, weights, cache, table, row_req, row_len, block_size):
    n, heads, d = q.shape
    out = torch.full((n, table.shape[1] * block_size), float("-inf"))
    for t in range(n):
        b = int(row_req[t])
        for s in range(int(row_len[t])):
            slot = int(table[b, s // block_size]) * block_size + s % block_size
            if cache.dtype == torch.uint8:
                key = decode_fp8_token(cache, slot, block_size, d)
            else:
                key = cache[slot // block_size, slot % block_size].float()
            out[t, s] = sum(float(weights[t, h]) * max(0.0, float(q[t, h].float() @ key))
                            for h in range(heads))
    return out


def filled_index_cache(lengths, d, block_size, fp8, gen, dtype=torch.float32):
    table, num_blocks = paged_requests(lengths, block_size, gen)
    if fp8:
        cache = torch.zeros(num_blocks, block_size * index_row_bytes(d), dtype=torch.uint8)
    else:
        cache = torch.zeros(num_blocks, block_size, d, dtype=dtype)
    for b, n in enumerate(lengths):
        ops.index_cache_write(cache, torch.randn(n, d, generator=gen), slots_for(table, b, range(n), block_size))
    return cache, table


@pytest.mark.parametrize("layout", ["float32", "bfloat16", "fp8"])
def test_lightning_indexer_matches_naive_loop(layout):
    gen = torch.Generator().manual_seed(4)
    d, heads, block_size = 32, 3, 8
    lengths = [5, 21, 13]
    dtype = torch.bfloat16 if layout == "bfloat16" else torch.float32
    cache, table = filled_index_cache(lengths, d, block_size, layout == "fp8", gen, dtype)
    row_req = torch.tensor([1, 0, 2, 1, 1, 2, 0], dtype=torch.int32)
    row_len = torch.tensor([21, 5, 1, 9, 20, 13, 3], dtype=torch.int32)
    q = torch.randn(7, heads, d, generator=gen).to(dtype)
    weights = torch.randn(7, heads, generator=gen) * (heads * d) ** -0.5
    got = ops.lightning_indexer(q, weights, cache, table, row_req, row_len)
    expect = naive_indexer(q, weights, cache, table, row_req, row_len, block_size)
    assert got.shape == (7, table.shape[1] * block_size) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    assert torch.allclose(got, expect, rtol=1e-5, atol=1e-5)


def naive_topk(scores, row_len, k):
    out = []
    for t in range(scores.shape[0]):
        visible = range(int(row_len[t]))
        best = sorted(visible, key=lambda s: (float(scores[t, s]), s), reverse=True)[:k]
        out.append(best + [-1] * (k - len(best)))
    return torch.tensor(out, dtype=torch.int32)


def test_topk_select_tie_rule_and_short_rows():
    gen = torch.Generator().manual_seed(5)
    k, width = 6, 24
    scores = torch.randn(8, width, generator=gen).relu()                   # ~half exact zeros
    scores[1] = torch.randint(0, 2, (width,), generator=gen).float()       # only two values
    scores[2, 3] = float("-inf")                                           # visible -inf still ranks
    row_len = torch.tensor([24, 24, 4, 6, 1, 17, 0, 11], dtype=torch.int32)
    got = ops.topk_select(scores, row_len, k)
    expect = naive_topk(scores, row_len, k)
    assert got.dtype == torch.int32 and got.shape == (8, k)
    assert torch.equal(got, expect)
    assert got[2].tolist()[3:] == [3, -1, -1]                         # -inf visible, then empty
    assert torch.equal(ops.topk_select(scores, row_len, 40), naive_topk(scores, row_len, 40))


def test_topk_tie_rule_prefers_recent_positions():
    scores = torch.zeros(1, 10)
    scores[0, 2] = 1.0
    got = ops.topk_select(scores, torch.tensor([8], dtype=torch.int32), 3)
    assert got.tolist() == [[2, 7, 6]]                                    # zeros: most recent first


def test_lightning_indexer_topk_matches_naive_indexer_and_naive_topk():
    gen = torch.Generator().manual_seed(6)
    d, heads, block_size = 32, 4, 8
    cache, table = filled_index_cache([30, 12], d, block_size, True, gen)
    row_req = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    row_len = torch.tensor([30, 17, 12, 3], dtype=torch.int32)
    q = torch.randn(4, heads, d, generator=gen)
    weights = torch.randn(4, heads, generator=gen)
    fused = ops.lightning_indexer_topk(q, weights, cache, table, row_req, row_len, 8)
    naive_scores = naive_indexer(q, weights, cache, table, row_req, row_len, block_size)
    assert torch.equal(fused, naive_topk(naive_scores, row_len, 8))    # oracles that share no code
    assert (fused[3, 3:] == -1).all()                                  # a row of 3 keys: then empty


# ---- sparse / dense MLA -------------------------------------------------------------------------

def naive_mla(q, cache, table, row_req, index_lists, sm_scale, dv):
    n, heads, _ = q.shape
    block_size = cache.shape[1]
    out, lse = torch.zeros(n, heads, dv), torch.zeros(n, heads)
    for t in range(n):
        b = int(row_req[t])
        rows = [cache[int(table[b, p // block_size]), p % block_size].float() for p in index_lists[t] if p >= 0]
        for h in range(heads):
            if not rows:
                lse[t, h] = float("inf")
                continue
            logits = [float(q[t, h].float() @ r) * sm_scale for r in rows]
            m = max(logits)
            total = sum(math.exp(x - m) for x in logits)
            lse[t, h] = m + math.log(total)
            for x, r in zip(logits, rows):
                out[t, h] += math.exp(x - m) / total * r[:dv]
    return out, lse


def filled_latent_cache(lengths, width, block_size, gen, dtype):
    table, num_blocks = paged_requests(lengths, block_size, gen)
    cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
    return cache, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_matches_naive_softmax(dtype):
    gen = torch.Generator().manual_seed(7)
    width, dv, heads, block_size = 40, 24, 3, 8
    cache, table = filled_latent_cache([19, 30], width, block_size, gen, dtype)
    row_req = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    indices = torch.tensor([[3, -1, 18, 0, 7], [29, 28, 1, -1, -1], [-1, -1, -1, -1, -1],
                            [-1, 5, -1, -1, -1]], dtype=torch.int32)
    q = torch.randn(4, heads, width, generator=gen).to(dtype)
    out, lse = ops.sparse_mla(q, cache, table, row_req, indices, 0.3, dv)
    expect_out, expect_lse = naive_mla(q, cache, table, row_req, indices.tolist(), 0.3, dv)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (4, heads, dv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), expect_out, atol=tol, rtol=tol)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isposinf(lse[2]).all()
    assert torch.allclose(lse[[0, 1, 3]], expect_lse[[0, 1, 3]], atol=1e-4, rtol=1e-5)


def test_sparse_equals_dense_when_every_row_sees_at_most_k():
    gen = torch.Generator().manual_seed(8)
    width, dv, heads, block_size, k = 40, 32, 2, 4, 16
    lengths = [16, 9, 13]
    cache, table = filled_latent_cache(lengths, width, block_size, gen, torch.float32)
    row_req = torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32)
    row_len = torch.tensor([16, 9, 13, 4, 1, 7], dtype=torch.int32)
    scores = torch.randn(6, table.shape[1] * block_size, generator=gen)
    indices = ops.topk_select(scores, row_len, k)                       # all visible, shuffled order
    q = torch.randn(6, heads, width, generator=gen)
    sparse = ops.sparse_mla(q, cache, table, row_req, indices, 0.2, dv)
    dense = ops.dense_mla(q, cache, table, row_req, row_len, 0.2, dv)
    assert torch.allclose(sparse[0], dense[0], atol=1e-6) and torch.allclose(sparse[1], dense[1], atol=1e-6)
    lists = [list(range(int(n))) for n in row_len]
    expect_out, expect_lse = naive_mla(q, cache, table, row_req, lists, 0.2, dv)
    assert torch.allclose(dense[0], expect_out, atol=1e-5) and torch.allclose(dense[1], expect_lse, atol=1e-5)


# ---- bad inputs ---------------------------------------------------------------------------------

def _bad_calls():
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    cache, rows, slots = torch.zeros(2, 4, 8), torch.ones(3, 8), torch.arange(3)
    icache, keys = torch.zeros(2, 4 * index_row_bytes(32), dtype=torch.uint8), torch.ones(3, 32)
    q, w = torch.ones(3, 2, 32), torch.ones(3, 2)
    table, req, ln = torch.zeros(1, 2, dtype=i32), torch.zeros(3, dtype=i32), torch.ones(3, dtype=i32)
    lat, qa = torch.zeros(2, 4, 8), torch.ones(3, 2, 8)
    idx = torch.zeros(3, 4, dtype=i32)
    return [
        ("rows", lambda: ops.mla_cache_write(cache, torch.ones(3, 7), slots)),
        ("slot_mapping", lambda: ops.mla_cache_write(cache, rows, slots.to(i32))),
        ("slot_mapping", lambda: ops.mla_cache_write(cache, rows, torch.tensor([0, 1, 8]))),
        ("cache", lambda: ops.index_cache_write(torch.zeros(2, 4 * 35, dtype=torch.uint8), keys, slots)),
        ("keys", lambda: ops.index_cache_write(icache, torch.ones(3, 32, dtype=i64), slots)),
        ("ln_bias", lambda: ops.index_key_norm_write(icache, keys, torch.ones(32), torch.ones(16), slots, 1e-6)),
        ("weights", lambda: ops.lightning_indexer(q, w.bfloat16(), icache, table, req, ln)),
        ("q", lambda: ops.lightning_indexer(torch.ones(3, 64), w, icache, table, req, ln)),
        ("index_cache", lambda: ops.lightning_indexer(q, w, torch.zeros(2, 4, 16), table, req, ln)),
        ("block_table", lambda: ops.lightning_indexer(q, w, icache, table.long(), req, ln)),
        ("row_len", lambda: ops.lightning_indexer(q, w, icache, table, req, ln.long())),
        ("row_len", lambda: ops.lightning_indexer(q, w, icache, table, req, ln * 9)),
        ("k", lambda: ops.topk_select(torch.ones(3, 8), ln, 0)),
        ("scores", lambda: ops.topk_select(torch.ones(3, 8, dtype=torch.float64), ln, 2)),
        ("indices", lambda: ops.sparse_mla(qa, lat, table, req, idx.long(), 0.5, 4)),
        ("indices", lambda: ops.sparse_mla(qa, lat, table, req, idx + 8, 0.5, 4)),
        ("dv", lambda: ops.sparse_mla(qa, lat, table, req, idx, 0.5, 9)),
        ("latent_cache", lambda: ops.dense_mla(qa, torch.zeros(2, 4, 6), table, req, ln, 0.5, 4)),
        ("row_req", lambda: ops.dense_mla(qa, lat, table, req[:2], ln, 0.5, 4)),
    ]


@pytest.mark.parametrize("arg,call", _bad_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_name_the_argument(arg, call):
    with pytest.raises(ValueError, match=arg):
        call()


def test_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(9)
    cache, table = filled_index_cache([10, 6], 32, 4, True, gen)
    row_req, row_len = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([10, 6], dtype=torch.int32)
    q, w = torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2, generator=gen)
    lat = torch.randn(cache.shape[0], 4, 40, generator=gen)
    torch.library.opcheck(ops.lightning_indexer_topk, (q, w, cache, table, row_req, row_len, 4))
    torch.library.opcheck(ops.index_cache_write, (cache, torch.randn(2, 32, generator=gen),
                                                  slots_for(table, 0, [1, 2], 4)))
    torch.library.opcheck(ops.dense_mla, (torch.randn(2, 3, 40, generator=gen), lat, table, row_req,
                                          row_len, 0.1, 16))
