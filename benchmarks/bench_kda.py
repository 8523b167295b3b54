"""KDA decode / verify and prefill at K3 shapes (issue 4; spec/performance.md §8 G8, G9).

Decode: B = 16 requests x R = 1 or 4 rows, 96 heads x 128, bf16 activations and conv window, fp32
state. k31c's `kda_decode` (prep, state pass, norm; the k31c column is the registered default
tile, a few other (BV, warps) tiles in the note) against, in the same run: fla's
`fused_recurrent_kda` alone (gate, beta sigmoid and q/k L2 norm in its kernel; inputs already
convolved), fla's chain (its causal conv + fused_recurrent_kda + FusedRMSNormGated), the eager
reference op and torch.compile of the reference math. Everything but the eager reference is
timed as CUDA-graph replays (fla's Python wrappers cost ~100 us per eager call). Floor: every
byte the layer must move (fp32 state read + written dominates: 6 MiB per request) over the copy
bandwidth measured in the run.

Prefill: one request of T = 8192 tokens from a live state, against fla's `chunk_kda` (and its
conv + chunk + norm chain) and the eager reference op; eager timing for all (ms scale). The k31c
column is the registered default launch, timed again after a sweep of launch configurations.

Decode at small batches (`small_batch_rows`, with --decode): the state-pass tile at B = 1 and 4,
k31c alone, cycling through 16 requests' states so the state is not L2-resident.

Run: PYTHONPATH=. python benchmarks/bench_kda.py [--prefill | --decode]   (the prefill or decode
rows alone; fla-core must be importable for the fla peers)
"""
from __future__ import annotations

import itertools

import torch

try:
    from benchmarks.harness import Machine, Row, bytes_floor_ms, markdown, measure_machine, time_ms
    from benchmarks.harness import graph_ms as harness_graph_ms
except ImportError:  # run as a script from benchmarks/
    from harness import Machine, Row, bytes_floor_ms, markdown, measure_machine, time_ms
    from harness import graph_ms as harness_graph_ms

H, K, W = 96, 128, 4
P = H * K
B_DECODE = 16
T_PREFILL = 8192
LB, EPS, CHUNK = -5.0, 1e-5, 64
ACT = torch.bfloat16


def graph_ms(fn) -> float:
    """Per-call time of fn replayed from one CUDA graph holding 20 calls."""
    return harness_graph_ms(fn, calls=20, warmup=2, reps=10)


def layer(num_slots: int, gen: torch.Generator) -> dict:
    dev = "cuda"
    return dict(conv_weight=(0.5 * torch.randn(3 * P, W, generator=gen)).to(dev),
                A_log=torch.empty(H).uniform_(1, 16, generator=gen).log().to(dev),
                dt_bias=torch.randn(P, generator=gen).to(dev),
                o_norm_weight=(1 + 0.1 * torch.randn(K, generator=gen)).to(dev),
                conv_state=torch.randn(num_slots, W - 1, 3 * P, generator=gen).to(dev, ACT),
                recurrent=(0.5 * torch.randn(num_slots, H, K, K, generator=gen)).to(dev))


def tokens(n: int, gen: torch.Generator) -> dict:
    t = {name: torch.randn(n, P, generator=gen) for name in ("q", "k", "v", "f", "gate")}
    t["beta"] = torch.randn(n, H, generator=gen)
    return {name: x.to("cuda", ACT) for name, x in t.items()}


def args(tok, lay):
    return (tok["q"], tok["k"], tok["v"], tok["f"], tok["beta"], tok["gate"], lay["conv_weight"],
            lay["A_log"], lay["dt_bias"], lay["o_norm_weight"], lay["conv_state"], lay["recurrent"])


def decode_bytes(B, R, snaps):
    state = 2 * B * H * K * K * 4
    rows = B * R * (6 * P * 2 + H * 2)                       # q k v f gate in, out; beta
    conv = 2 * B * (W - 1) * 3 * P * 2
    snap = B * R * (H * K * K * 4 + (W - 1) * 3 * P * 2) if snaps else 0
    return state + rows + conv + snap


def torch_decode(u, f, beta, gate, conv_weight, A_log, dt_bias, norm_w, conv_state, state, R):
    """The reference math for B live requests (slots 0..B-1), vectorised over requests: the peer
    that torch.compile gets (the op itself is opaque and syncs on its slot list)."""
    from k31c.graph.ops.kda import (causal_conv_silu, gated_rms_norm, kda_gate, kda_step,
                                    l2_normalize)
    B = u.shape[0] // R
    y, window = causal_conv_silu(u.unflatten(0, (B, R)), conv_weight, conv_state[:B])
    q, k, v = (t.unflatten(-1, (H, K)) for t in y.split(P, dim=-1))
    q, k = l2_normalize(q), l2_normalize(k)
    g = kda_gate(f, A_log, dt_bias, LB).unflatten(0, (B, R))
    b = torch.sigmoid(beta.float()).unflatten(0, (B, R))
    S, outs = state[:B], []
    for r in range(R):
        o, S = kda_step(S, q[:, r], k[:, r], v[:, r], g[:, r], b[:, r], K ** -0.5)
        outs.append(o)
    state[:B] = S
    conv_state[:B] = window.to(conv_state.dtype)
    o = torch.stack(outs, 1).flatten(0, 1)
    return gated_rms_norm(o, norm_w, gate.unflatten(-1, (H, K)), EPS).flatten(-2).to(u.dtype)


def fla_decode_peers(tok, lay, B, R):
    """fla's fused_recurrent_kda alone, and fla's conv + recurrent + gated-norm chain."""
    from fla.modules import FusedRMSNormGated
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.kda import fused_recurrent_kda
    qkv = lambda name: tok[name].view(B, R, H, K)  # noqa: E731
    state = lay["recurrent"][:B]

    def recurrent_only():
        return fused_recurrent_kda(qkv("q"), qkv("k"), qkv("v"), qkv("f"), tok["beta"].view(B, R, H),
                                   A_log=lay["A_log"], dt_bias=lay["dt_bias"], initial_state=state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                   lower_bound=LB)

    x = torch.cat([tok["q"], tok["k"], tok["v"]], -1).view(B, R, 3 * P)
    w = lay["conv_weight"].to(ACT)
    cache = torch.randn(B, 3 * P, W, device="cuda", dtype=ACT)
    norm = FusedRMSNormGated(K, eps=EPS, activation="sigmoid").to("cuda")

    def chain():
        y, _ = causal_conv1d(x, w, initial_state=cache, output_final_state=True, activation="silu")
        q, k, v = (t.reshape(B, R, H, K) for t in y.split(P, dim=-1))
        o, _ = fused_recurrent_kda(q, k, v, qkv("f"), tok["beta"].view(B, R, H), A_log=lay["A_log"],
                                   dt_bias=lay["dt_bias"], initial_state=state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                   lower_bound=LB)
        return norm(o.reshape(-1, K), tok["gate"].view(-1, K))

    return {"fla recurrent": recurrent_only, "fla chain": chain}


def decode_rows(m: Machine, torch_peers: bool = True, compile_peer: bool = True,
                configs=((64, 4), (32, 4), (32, 2), (16, 2), (128, 4)),
                rows=(1, 4)) -> list[Row]:
    """kda_decode swept over `configs` (BV, warps; BV = K: one program a head, gated norm fused,
    no norm launch), the default tile reported and the best named; R > 1 also with per-row
    snapshots, at the launcher's default tile."""
    from k31c.lowering.triton.kda_decode import decode_tile, launch_kda_decode
    out, B = [], B_DECODE
    gen = torch.Generator().manual_seed(0)
    lay = layer(B, gen)
    slots = torch.arange(B, device="cuda")
    for R in rows:
        tok = tokens(B * R, gen)
        shape = f"B={B} R={R} H={H} K=V={K}"
        snap = (torch.empty(B, R, W - 1, 3 * P, device="cuda", dtype=ACT),
                torch.empty(B, R, H, K, K, device="cuda"))

        def run(cfg=(None, None), sn=(None, None), state_first=None, **knobs):
            return launch_kda_decode(*args(tok, lay), slots, R, LB, EPS, *sn, block_v=cfg[0],
                                     num_warps=cfg[1], state_first=state_first, **knobs)

        sweep = {cfg: graph_ms(lambda cfg=cfg: run(cfg)) for cfg in configs}
        best = min(sweep, key=sweep.get)
        peers = {}
        notes = ["(BV,warps) " + " ".join(f"{','.join(map(str, cfg))}:{t * 1e3:.1f}us"
                                          for cfg, t in sweep.items())]
        # the default tile with the state pass as the prep's PDL dependent, and after it
        paired = graph_ms(lambda: run(state_first=True))
        plain = graph_ms(lambda: run(state_first=False))
        notes.append(f"default tile, state pass paired {paired * 1e3:.1f}us, plain {plain * 1e3:.1f}us")
        # the launches alone (outputs unfinished) and the prep's warps, at the default tile; with
        # a norm launch (BV < K) also the norm alone and the step without it: what fusing it saves
        norm = decode_tile(R, K)[0] < K
        parts = {st: graph_ms(lambda st=st: run(stages=st, state_first=False))
                 for st in ("p", "s") + (("n", "ps") if norm else ())}
        preps = {w: graph_ms(lambda w=w: run(prep_warps=w, state_first=False)) for w in (1, 2, 4)}
        notes.append(f"prep alone {parts['p'] * 1e3:.1f}us, state pass alone {parts['s'] * 1e3:.1f}us"
                     + (f", norm alone {parts['n'] * 1e3:.1f}us, prep + state without the norm "
                        f"{parts['ps'] * 1e3:.1f}us" if norm else "") + "; "
                     "prep warps " + " ".join(f"{w}:{t * 1e3:.1f}us" for w, t in preps.items()))
        try:
            fla_peers = fla_decode_peers(tok, lay, B, R)
        except Exception as e:  # noqa: BLE001  (a missing/failed peer is reported, not hidden)
            fla_peers = {}
            notes.append(f"fla failed: {type(e).__name__}: {str(e)[:80]}")
        for name, fn in fla_peers.items():
            try:
                with torch.inference_mode():
                    peers[name] = graph_ms(fn)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {type(e).__name__}: {str(e)[:80]}")
        u = torch.cat([tok["q"], tok["k"], tok["v"]], -1)
        ref_args = (u, tok["f"], tok["beta"], tok["gate"], lay["conv_weight"], lay["A_log"],
                    lay["dt_bias"], lay["o_norm_weight"], lay["conv_state"], lay["recurrent"], R)
        if torch_peers:
            peers["torch eager"] = time_ms(lambda: torch.ops.k31c.kda_decode(
                *args(tok, lay), slots, R, LB, EPS, None, None), warmup=2, reps=5)
        if compile_peer:
            try:
                compiled = torch.compile(torch_decode, dynamic=False)
                peers["torch.compile"] = graph_ms(lambda: compiled(*ref_args))
            except Exception as e:  # noqa: BLE001
                notes.append(f"compile failed: {type(e).__name__}: {str(e)[:80]}")
        floor = bytes_floor_ms(decode_bytes(B, R, False), m)
        default = sweep.get(decode_tile(R, K)) or graph_ms(lambda: run())
        fla = peers.get("fla recurrent")
        if fla:
            notes.append(f"fla/k31c {fla / default:.2f}x at the default tile, "
                         f"{fla / sweep[best]:.2f}x at the best")
        out.append(Row("kda_decode", shape, default, floor, "bytes", peers,
                       f"k31c at the default (BV,warps) {decode_tile(R, K)}; best {best}; "
                       + "; ".join(notes)))
        if R > 1:
            ms = graph_ms(lambda: run(sn=snap))
            out.append(Row("kda_decode +snapshots", shape, ms,
                           bytes_floor_ms(decode_bytes(B, R, True), m), "bytes", {},
                           f"at its default (BV,warps) {decode_tile(R, K)}; state + conv window "
                           "written after every row"))
    return out


def small_batch_rows(m: Machine, batches=(1, 4),
                     configs=((32, 4), (64, 4), (128, 4), (16, 2)),
                     slots_in_pool: int = 16) -> list[Row]:
    """The decode tile at the small batches of a serving step (R = 1): k31c only, each (BV, warps)
    of `configs`, as CUDA-graph replays of 20 calls that cycle through the states of
    `slots_in_pool` requests (6 MiB each, 96 MiB in all: past the L2, as in a decode step where
    the weights stream between two layers' states)."""
    from k31c.lowering.triton.kda_decode import decode_tile, launch_kda_decode
    gen = torch.Generator().manual_seed(1)
    lay = layer(slots_in_pool, gen)
    out = []
    for B in batches:
        tok = tokens(B, gen)
        sets = [torch.arange(j * B, (j + 1) * B, device="cuda") % slots_in_pool
                for j in range(slots_in_pool // B)]

        turn = itertools.count()

        def run(cfg, state_first=None):
            return launch_kda_decode(*args(tok, lay), sets[next(turn) % len(sets)], 1, LB, EPS, None, None,
                                     block_v=cfg[0], num_warps=cfg[1], state_first=state_first)

        sweep = {cfg: graph_ms(lambda cfg=cfg: run(cfg)) for cfg in configs}
        best = min(sweep, key=sweep.get)
        paired, plain = (graph_ms(lambda f=f: run(decode_tile(1, K), state_first=f)) for f in (True, False))
        out.append(Row("kda_decode", f"B={B} R=1 H={H} K=V={K}, {slots_in_pool} states cycled", sweep[best],
                       bytes_floor_ms(decode_bytes(B, 1, False), m), "bytes", {},
                       f"best (BV,warps) {best} (default {decode_tile(1, K)}); (BV,warps) "
                       + " ".join(f"{','.join(map(str, c))}:{t * 1e3:.1f}us" for c, t in sweep.items())
                       + f"; default tile, state pass paired {paired * 1e3:.1f}us, plain {plain * 1e3:.1f}us"))
    return out


# launch configurations of the prefill sweep: launch_kda_prefill's keywords, those left out the
# target's (`launch_defaults`), and the chunk size (the math does not depend on it, the kernels'
# time does); the first is what the registered op launches on the H200 (`kernel_chunk`)
PREFILL_CONFIGS = (
    dict(chunk=16), dict(chunk=16, state_stages=6), dict(chunk=16, state_warps=8, block_v=128),
    dict(chunk=32), dict(chunk=64), dict(chunk=64, chunk_warps=4),
)


def _label(config: dict) -> str:
    """chunk size, chunk warps, state warps, V tile, state stages of a configuration, as planned."""
    from k31c.lowering.triton.device import target_of
    from k31c.lowering.triton.kda_prefill import plan
    c = dict(config)
    p = plan(target_of(torch.device("cuda")), 1, c.pop("chunk", CHUNK), K, W, ACT, LB, **c)
    return f"{p.C},{p.chunk_warps},{p.state_warps},{p.block_v},{p.state_stages}"


def prefill_inputs() -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """(layer, tokens, slots, cu_seqlens) of the prefill rows: one request of T_PREFILL tokens
    from slot 0's live state (seed 1; try_kda_prefill.py probes the same inputs)."""
    gen = torch.Generator().manual_seed(1)
    lay = layer(1, gen)
    tok = tokens(T_PREFILL, gen)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    cu = torch.tensor([0, T_PREFILL], dtype=torch.int32, device="cuda")
    return lay, tok, slots, cu


def fla_chunk_kda(tok: dict, lay: dict, q=None, k=None, v=None):
    """fla's chunk_kda on the prefill inputs (gate, beta sigmoid and q/k L2 norm in its kernel;
    q, k, v default to the tokens' own, unconvolved), from slot 0's state."""
    from fla.ops.kda import chunk_kda
    view = lambda x: x.view(1, T_PREFILL, H, K)  # noqa: E731
    q, k, v = (view(tok[n]) if x is None else x for n, x in (("q", q), ("k", k), ("v", v)))
    return chunk_kda(q, k, v, view(tok["f"]), tok["beta"].view(1, T_PREFILL, H), A_log=lay["A_log"],
                     dt_bias=lay["dt_bias"], initial_state=lay["recurrent"][:1],
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB)


def prefill_rows(m: Machine, torch_peers: bool = True, configs=PREFILL_CONFIGS) -> list[Row]:
    """The chunked prefill at T_PREFILL over launch configurations (`PREFILL_CONFIGS`, the first
    the registered default), the default beside fla's chunk_kda; then each pass alone at the
    best configuration."""
    from k31c.lowering.triton.kda_prefill import launch_kda_prefill
    T = T_PREFILL
    lay, tok, slots, cu = prefill_inputs()
    shape = f"T={T} B=1 H={H} K=V={K}"

    def launch(config, layer=lay, chunk=None, **more):
        c = dict(config)
        size = c.pop("chunk", CHUNK)                     # a config may name its chunk size
        return launch_kda_prefill(*args(tok, layer), slots, cu, LB, EPS, chunk or size, **c, **more)
    sweep = [time_ms(lambda: launch(c), reps=10) for c in configs]
    best = min(range(len(configs)), key=sweep.__getitem__)
    # the registered default again on the now-warm machine: the k31c time reported
    default_ms = time_ms(lambda: launch(configs[0]), reps=10)
    peers, notes = {}, ["(chunk size, chunk warps, state warps, BV, state stages) " + " ".join(
        f"{_label(c)}:{t:.3f}" for c, t in zip(configs, sweep))]
    alone = [time_ms(lambda: launch(configs[best], stages=stage), reps=10) for stage in "vcsn"]
    notes.append(f"passes alone at {_label(configs[best])} (conv / chunk / state / norm) ms: "
                 + " / ".join(f"{t:.3f}" for t in alone))
    # where the passes' time goes: the conv pass on 8 warps and with 2 taps (the taps' price);
    # the chunk pass with 64- and 32-row chunks (more 16-row blocks a program in sequence)
    lay2 = dict(lay, conv_weight=lay["conv_weight"][:, :2].contiguous(),
                conv_state=lay["conv_state"][:, :1].contiguous())
    w2 = time_ms(lambda: launch(configs[best], layer=lay2, stages="v"), reps=10)
    v8 = time_ms(lambda: launch(dict(configs[best], conv_warps=8), stages="v"), reps=10)
    by_chunk = {c: time_ms(lambda c=c: launch(configs[best], chunk=c, stages="c"), reps=10)
                for c in (64, 32)}
    notes.append(f"conv pass alone: 8 warps {v8:.3f} ms, 2 taps {w2:.3f} ms; chunk pass alone: "
                 f"chunk 64 {by_chunk[64]:.3f}, chunk 32 {by_chunk[32]:.3f} ms")
    try:
        from fla.modules import FusedRMSNormGated
        from fla.modules.causal_conv1d import causal_conv1d

        x = torch.cat([tok["q"], tok["k"], tok["v"]], -1).view(1, T, 3 * P)
        w = lay["conv_weight"].to(ACT)
        cache = torch.randn(1, 3 * P, W, device="cuda", dtype=ACT)
        norm = FusedRMSNormGated(K, eps=EPS, activation="sigmoid").to("cuda")

        def fla_chain():
            y, _ = causal_conv1d(x, w, initial_state=cache, output_final_state=True, activation="silu")
            q, k, v = (t.reshape(1, T, H, K) for t in y.split(P, dim=-1))
            o, _ = fla_chunk_kda(tok, lay, q, k, v)
            return norm(o.reshape(-1, K), tok["gate"].view(-1, K))

        with torch.inference_mode():
            peers["fla chunk_kda"] = time_ms(lambda: fla_chunk_kda(tok, lay), reps=10)
            peers["fla chain"] = time_ms(fla_chain, reps=10)
        notes.append(f"fla/k31c {peers['fla chunk_kda'] / default_ms:.2f}x at the default, "
                     f"{peers['fla chunk_kda'] / sweep[best]:.2f}x at the best")
    except Exception as e:  # noqa: BLE001
        notes.append(f"fla failed: {type(e).__name__}: {str(e)[:80]}")
    if torch_peers:
        peers["torch eager"] = time_ms(lambda: torch.ops.k31c.kda_prefill(
            *args(tok, lay), slots, cu, LB, EPS, CHUNK), warmup=1, reps=2)
        notes.append("torch.compile not timed (per-chunk Python loop, 128 chunks)")
    nbytes = T * (6 * P * 2 + H * 2) + 2 * H * K * K * 4
    return [Row("kda_prefill", shape, default_ms, bytes_floor_ms(nbytes, m), "bytes", peers,
                f"the default {_label(configs[0])} after the sweep (first in it {sweep[0]:.3f}); "
                f"best {_label(configs[best])}; " + "; ".join(notes))]


def run(machine: Machine) -> list[Row]:
    import k31c.graph.ops.kda  # noqa: F401  (registers the reference ops)
    return decode_rows(machine) + prefill_rows(machine)


if __name__ == "__main__":
    import sys
    import k31c.graph.ops.kda  # noqa: F401  (registers the reference ops)
    flags = set(sys.argv[1:])
    if flags - {"--prefill", "--decode"} or len(flags) > 1:
        sys.exit(f"bench_kda: expected nothing, --prefill or --decode, got {' '.join(sys.argv[1:])}")
    m = measure_machine()
    rows = prefill_rows(m) if "--prefill" in flags else \
        decode_rows(m) + small_batch_rows(m) if "--decode" in flags else run(m)
    print(markdown(rows, m))
