"""The contiguous plain-PyTorch peers (benchmarks/peers.py, spec Appendix B's formulation) compute
what the k31c ops compute, on the CPU at small shapes: the dense control against the reference
dense_mla on the same rows read through a shuffled block table, the sparse layer's attention
against the reference sparse_mla on the same picks, and the FP8 index keys dequantised as the
reference indexer dequantises them."""
import torch

import k31c.graph.ops  # noqa: F401  (torch.ops.k31c.*)
from benchmarks import peers

B, R, H, W, DV, BS, NB = 3, 2, 4, 24, 16, 8, 5      # requests, rows, heads, row width, dv, block, blocks


def _paged(seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(B * NB + 3, BS, W, generator=g)
    table = torch.randperm(B * NB + 3, generator=g)[: B * NB].view(B, NB).to(torch.int32)
    q = torch.randn(B * R, H, W, generator=g)
    row_req = torch.arange(B, dtype=torch.int32).repeat_interleave(R)
    row_len = torch.tensor([40, 37, 12, 13, 1, 30], dtype=torch.int32)
    return g, cache, table, q, row_req, row_len


def test_contiguous_dense_matches_reference_op():
    _, cache, table, q, row_req, row_len = _paged()
    want, _ = torch.ops.k31c.dense_mla(q, cache, table, row_req, row_len, 0.3, DV)
    latent = peers.contiguous_latent(cache, table)
    assert latent.shape == (B, NB * BS, W)
    got = peers.contiguous_dense_mla(peers.by_request(q, B), latent, row_len.view(B, R), 0.3, DV)
    torch.testing.assert_close(got.flatten(0, 1), want, atol=1e-5, rtol=1e-5)


def test_contiguous_sparse_attention_matches_reference_op():
    g, cache, table, q, row_req, row_len = _paged(1)
    k = 6
    idx = torch.stack([torch.randperm(int(n), generator=g)[:k] if n >= k else
                       torch.arange(k) % int(n) for n in row_len]).to(torch.int32)
    idx[4] = 0                          # a row with one visible key: all picks the same position
    want, _ = torch.ops.k31c.sparse_mla(q, cache, table, row_req, idx, 0.3, DV)
    got = peers.contiguous_sparse_mla(peers.by_request(q, B), peers.contiguous_latent(cache, table),
                                      peers.by_request(idx.long(), B), 0.3, DV)
    # repeated picks of row 4 count once per pick in both
    torch.testing.assert_close(got.flatten(0, 1), want, atol=1e-5, rtol=1e-5)


def test_contiguous_index_keys_dequantise_fp8_blocks():
    g = torch.Generator().manual_seed(2)
    dim = 16
    values = torch.randn(B * NB, BS, dim, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(B * NB, BS, generator=g) + 0.5
    raw = torch.cat([values.view(torch.uint8).flatten(1), scales.view(torch.uint8).view(B * NB, -1)], 1)
    table = torch.randperm(B * NB, generator=g).view(B, NB).to(torch.int32)
    keys = peers.contiguous_index_keys(raw, table, BS, dim)
    assert keys.shape == (B, NB * BS, dim) and keys.dtype == torch.bfloat16
    want = (values.float() * scales[..., None])[table.long()].flatten(1, 2).to(torch.bfloat16)
    assert torch.equal(keys, want)


def test_contiguous_topk_excludes_invisible_positions():
    g = torch.Generator().manual_seed(3)
    L, hi, di, k = 64, 2, 8, 5
    qi = torch.randn(B, R, hi, di, generator=g)
    ki = torch.randn(B, L, di, generator=g)
    w = torch.rand(B, R, hi, generator=g)
    lens = torch.tensor([[10, 11], [64, 64], [5, 6]])
    idx = peers.contiguous_indexer_topk(qi, ki, w, lens, k)
    assert bool((idx < lens[..., None]).all())
    s = ((torch.einsum("brhd,bld->brhl", qi, ki).relu() * w[..., None]).sum(2))
    for b in range(B):
        for r in range(R):
            best = s[b, r, :lens[b, r]].topk(k).indices       # the visible positions only
            assert set(idx[b, r].tolist()) == set(best.tolist()), (b, r)
