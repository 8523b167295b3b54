"""Diagnosis: decode projections at bench-config widths, cuBLAS separate vs merged vs a Triton GEMV."""
import torch, triton, triton.language as tl
from benchmarks.harness import graph_ms, measure_machine, bytes_floor_ms

@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :], mask=(rn[:, None] < N) & ((k + rk)[None, :] < K), other=0.0)
        x = tl.load(x_ptr + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

def tgemv(x, w, y, BN, BK, warps, stages):
    M, K = x.shape; N = w.shape[0]
    _gemv[(triton.cdiv(N, BN),)](x, w, y, M, N, K, BM=16, BN=BN, BK=BK, num_warps=warps, num_stages=stages)

mach = measure_machine()
print(f"copy {mach.copy_gbps:.0f} GB/s")
H = 7168
def copies(n, k):
    per = n * k * 2
    r = max(2, int(3e8 // per) + 1)
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(min(r, 8))]

def t_linear(M, n, k):
    ws = copies(n, k); x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    ms = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws], calls=1) / len(ws)
    return ms

def t_triton(M, n, k):
    ws = copies(n, k); x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, ws[0]).float()
    best = None
    for BN in (16, 32, 64):
        for BK in (128, 256, 512):
            for warps in (4, 8):
                for st in (3, 4):
                    try:
                        tgemv(x, ws[0], y, BN, BK, warps, st)
                        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                        ms = graph_ms(lambda: [tgemv(x, w, y, BN, BK, warps, st) for w in ws]) / len(ws)
                    except Exception as e:
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, (BN, BK, warps, st), err)
    return best

groups = {
    "kda_in": [(12288, H)] * 4 + [(128, H), (96, H)],
    "mlp_in": [(4096, H)] * 2,
    "moe_in": [(8, H), (512, H), (512, H), (3584, H)],
    "mla_in": [(1536, H), (576, H)],
    "mla_q": [(18432, 1536), (4096, 1536)],
    "idx_kw": [(128, H), (32, H)],
}
singles = [(7168, 12288), (7168, 4096), (7168, 3584), (7168, 512), (4096, H), (12288, 128), (7168, 4096 + 0)]
for M in (1, 16):
    print(f"\n== M = {M}")
    for name, shapes in groups.items():
        sep = [t_linear(M, n, k) for n, k in shapes]
        ks = {k for _, k in shapes}; assert len(ks) == 1
        ntot = sum(n for n, _ in shapes); k = shapes[0][1]
        merged = t_linear(M, ntot, k)
        fl = bytes_floor_ms(ntot * k * 2, mach)
        tr = t_triton(M, ntot, k)
        print(f"{name:8s} N={ntot} K={k} floor {fl*1e3:.1f}us  separate {sum(sep)*1e3:.1f}us {[round(s*1e3,1) for s in sep]}  merged {merged*1e3:.1f}us  triton {tr[0]*1e3:.1f}us {tr[1]} err {tr[2]:.1e}")
    for n, k in singles:
        fl = bytes_floor_ms(n * k * 2, mach)
        tr = t_triton(M, n, k)
        print(f"single   N={n} K={k} floor {fl*1e3:.1f}us  cublas {t_linear(M, n, k)*1e3:.1f}us  triton {tr[0]*1e3:.1f}us {tr[1]}")
