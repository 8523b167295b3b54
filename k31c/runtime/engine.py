"""The engine: requests, step metadata, prefill / decode / verify, sampling and generation.

It drives any callable with the model's step interface `fn(input_ids, meta, caches, mode, rows)`,
the eager model or a compiled one, over a CachePool.

Chunked prefill: one prefill step carries at most `max_prefill_tokens` rows. A longer prefill (one
long prompt, or many prompts together) runs as several steps, each appending the next chunk of
every request onto its own prefix (rows see the keys earlier steps wrote, through row_len), so
what a step allocates (the indexer's [rows, keys] scores, attention scratch, logits) is bounded by
the chunk, not by the prompt. The result equals one prefill of everything.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Callable, Optional, Sequence

import torch

from ..config import K31Config
from ..errors import RuntimeFailure, UsageError
from ..graph.step import StepMeta, step_meta, step_to_device
from .kv import CachePool


DEFAULT_MAX_PREFILL_TOKENS = 8192
SEED_MAX = 2**64 - 1   # torch.Generator.manual_seed takes 64 bits


class NonFiniteLogits(RuntimeFailure):
    """The model produced NaN or inf logits (NaN/inf weights, or values that overflow)."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def check_sampling(temperature, top_p) -> None:
    """temperature: 0 (greedy) or a finite positive number; top_p in (0, 1]."""
    if not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:  # NaN fails
        raise UsageError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1], got {top_p!r}")


class Engine:
    def __init__(self, model, *, max_requests: int = 8, max_seq_len: Optional[int] = None,
                 block_size: int = 16, index_cache: Optional[str] = None, latent_cache: Optional[str] = None,
                 device=None, step_fn=None, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        _positive_int("max_prefill_tokens", max_prefill_tokens)
        self.max_prefill_tokens = max_prefill_tokens
        if not isinstance(getattr(model, "config", None), K31Config):
            raise UsageError(f"model must be a K3.1 model (K31ForCausalLM) or what k31c.compile returns, "
                             f"got {type(model).__module__}.{type(model).__qualname__}")
        _positive_int("max_requests", max_requests)
        _positive_int("block_size", block_size)
        if max_seq_len is not None:   # None: the default below; 0 is an error, not the default
            _positive_int("max_seq_len", max_seq_len)
            if max_seq_len > model.config.max_seq_len:
                raise UsageError(f"max_seq_len {max_seq_len} exceeds the model's maximum length "
                                 f"{model.config.max_seq_len}")
        # a compiled model's quantize options (as the model or as the step function)
        formats = getattr(model if step_fn is None else step_fn, "cache_formats", {})
        index_cache = index_cache or formats.get("index_cache", "bf16")
        latent_cache = latent_cache or formats.get("latent_cache", "model")
        self.model = model
        self.cfg = model.config
        self.device = _device(device) if device is not None else next(model.parameters()).device
        self.max_seq_len = max_seq_len if max_seq_len is not None else min(self.cfg.max_seq_len, 4096)
        self.pool = CachePool(self.cfg, max_requests=max_requests, max_seq_len=self.max_seq_len,
                              block_size=block_size, index_cache=index_cache, latent_cache=latent_cache,
                              device=self.device)
        self.step_fn = model if step_fn is None else step_fn   # a module's truth value is its len()
        # a compiled model takes a step's ids and metadata on the host (its device graphs stage them)
        self._host_inputs = bool(getattr(self.step_fn, "host_step_inputs", False)) and self.device.type == "cuda"

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self) -> int:
        return self.pool.add_request()

    def free(self, rid: int) -> None:
        self._request(rid)
        self.pool.free(rid)

    def length(self, rid: int) -> int:
        return self._request(rid).length

    def _request(self, rid: int):
        try:
            return self.pool.requests[rid]
        except (KeyError, TypeError):   # TypeError: an unhashable rid
            raise UsageError(f"no request {rid!r} (never added, or already freed)") from None

    # ---- steps ----------------------------------------------------------------------------------------
    def _check_tokens(self, tokens: Sequence[int]) -> None:
        V = self.cfg.vocab_size
        for t in tokens:   # int() would truncate 1.5 and parse "7"
            try:
                operator.index(t)
            except TypeError:
                raise UsageError(f"token ids must be integers, got {t!r}") from None
        bad = [t for t in tokens if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"token ids out of range [0, {V}): {bad[:8]}")

    def _inputs(self, rids: Sequence[int], starts: list[int], counts: list[int],
                tokens: Sequence[int]) -> tuple[torch.Tensor, StepMeta]:
        """(token ids, StepMeta) of a step: on the host for a step function that takes them there
        (a compiled model: its device graphs stage them themselves), else on the device (the int64
        fields in one copy, the int32 fields and the requests' block-table rows, kept on the host
        by the pool, in another)."""
        pool = self.pool
        slot_mapping, row_req, row_len, cu = [], [], [], [0]
        for b, (rid, s, n) in enumerate(zip(rids, starts, counts)):
            pool.reserve(rid, s + n)
            slot_mapping += pool.slots_for(rid, s, s + n)
            row_req += [b] * n
            row_len += list(range(s + 1, s + n + 1))
            cu.append(cu[-1] + n)
        slots = [pool.requests[r].slot for r in rids]
        ids = torch.tensor(list(map(int, tokens)), dtype=torch.int64)
        meta = step_meta(slot_mapping=slot_mapping, block_table=pool.block_table[slots], row_req=row_req,
                         row_len=row_len, kda_slots=slots, cu_seqlens=cu, device="cpu")
        if self._host_inputs:
            return ids, meta
        return step_to_device(ids, meta, self.device)

    @torch.no_grad()
    def prefill(self, rids: Sequence[int], tokens: Sequence[Sequence[int]],
                logits: str = "all") -> torch.Tensor:
        """Append `tokens[b]` to request `rids[b]` (a fresh request or a chunk after a prefix), in
        steps of at most `max_prefill_tokens` rows. Returns logits float32 in row order:
        [sum(len), vocab] (logits="all") or each request's last row, [B, vocab] (logits="last",
        what generation needs; a long prompt then never holds [len, vocab])."""
        if len(rids) != len(tokens) or any(len(t) == 0 for t in tokens):
            raise ValueError("prefill needs one non-empty token list per request")
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if len(set(rids)) != len(rids):
            raise ValueError("prefill: a request appears twice in one call")
        tokens = [list(t) for t in tokens]
        self._check_tokens([t for ts in tokens for t in ts])
        for r, t in zip(rids, tokens):
            if self.length(r) + len(t) > self.max_seq_len:
                raise ValueError(f"request {r} would reach {self.length(r) + len(t)} tokens; "
                                 f"max_seq_len is {self.max_seq_len}")
        pieces: list[list[torch.Tensor]] = [[] for _ in rids]
        for step in self._prefill_steps([len(t) for t in tokens]):
            # step: (request index, start within its tokens, count) per request in this step
            out = self._prefill_step([rids[b] for b, _, _ in step],
                                     [tokens[b][a:a + n] for b, a, n in step])
            row = 0
            for b, a, n in step:
                last = a + n == len(tokens[b])
                if logits == "all":
                    pieces[b].append(out[row:row + n])
                elif last:   # a copy: a view would keep the step's [rows, vocab] alive
                    pieces[b].append(out[row + n - 1:row + n].clone())
                row += n
        return torch.cat([p for ps in pieces for p in ps])

    def _prefill_steps(self, lengths: list[int]) -> list[list[tuple[int, int, int]]]:
        """Split the prefill of requests with `lengths` new tokens into steps of at most
        max_prefill_tokens rows: each step takes the next chunk of every unfinished request in
        order (a request's chunks stay in order, one per step)."""
        done = [0] * len(lengths)
        steps = []
        while any(d < n for d, n in zip(done, lengths)):
            budget, step = self.max_prefill_tokens, []
            for b, n in enumerate(lengths):
                take = min(n - done[b], budget)
                if take > 0:
                    step.append((b, done[b], take))
                    done[b] += take
                    budget -= take
                if budget == 0:
                    break
            steps.append(step)
        return steps

    def _prefill_step(self, rids: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """One prefill step (at most max_prefill_tokens rows): logits [sum(len), vocab]."""
        flat = [t for ts in tokens for t in ts]
        starts = [self.length(r) for r in rids]
        ids, meta = self._inputs(rids, starts, [len(t) for t in tokens], flat)
        logits = self.step_fn(ids, meta, self.pool.caches(), "prefill", 1)
        for r, t in zip(rids, tokens):
            self.pool.requests[r].length += len(t)
        return logits

    @torch.no_grad()
    def decode(self, rids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One new token per request. Returns logits [B, vocab]."""
        return self.verify(rids, [[t] for t in tokens])[0]

    @torch.no_grad()
    def verify(self, rids: Sequence[int], rows: Sequence[Sequence[int]]):
        """R rows per request (last accepted token + drafts), processed as one decode step.
        Returns (logits [B*R, vocab], handle); pass the handle to `accept` to commit."""
        R = len(rows[0])
        if any(len(r) != R for r in rows) or len(rows) != len(rids) or R == 0:
            raise ValueError("verify needs the same positive number of rows for every request")
        flat = [t for rs in rows for t in rs]
        self._check_tokens(flat)
        starts = [self.length(r) for r in rids]
        ids, meta = self._inputs(rids, starts, [R] * len(rids), flat)
        snaps = self.pool.new_snapshots(len(rids), R) if R > 1 else None
        logits = self.step_fn(ids, meta, self.pool.caches(snaps), "decode", R)
        for r in rids:
            self.pool.requests[r].length += R
        return logits, (list(rids), starts, R, snaps)

    def accept(self, handle, accepted: Sequence[int]) -> None:
        """Keep the first accepted[b] rows of request b from a `verify`; roll back the rest."""
        rids, starts, R, snaps = handle
        if R > 1:
            self.pool.rollback([self.pool.requests[r].slot for r in rids], list(accepted), R, snaps)
        elif any(a != 1 for a in accepted):
            raise ValueError("a single-row step can only accept its row")
        for r, s, a in zip(rids, starts, accepted):
            self.pool.requests[r].length = s + a

    @torch.no_grad()
    def run_once(self, steps: Sequence[tuple[str, int]], seed: int = 0) -> None:
        """Run each step of `steps` ((mode, rows): ("prefill", 1), ("decode", R)) once on a
        throwaway request with random token ids, then free it, so that what happens at a step's
        first run (Triton compiling the kernels it launches, a decode step capturing its device
        graph for one request) happens now. Prefill runs at 7 and 16 tokens: Triton compiles an
        integer argument divisible by 16 into its own kernel variant."""
        gen = torch.Generator().manual_seed(seed)
        for mode, rows in steps:
            if mode == "prefill":
                lengths = sorted({min(n, self.max_seq_len) for n in (7, 16)})
            else:                    # a verification longer than a request never runs
                lengths = [rows] if rows <= self.max_seq_len else []
            for n in lengths:
                tokens = torch.randint(self.cfg.vocab_size, (n,), generator=gen).tolist()
                rid = self.add_request()
                try:
                    if mode == "prefill":
                        self.prefill([rid], [tokens], logits="last")
                    else:
                        self.verify([rid], [tokens])
                finally:
                    self.free(rid)

    # ---- user-level -----------------------------------------------------------------------------------
    def prefill_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 of one prefill of a fresh request."""
        self._check_length(len(tokens))
        rid = self.add_request()
        try:
            return self.prefill([rid], [list(tokens)])
        finally:
            self.free(rid)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0,
                 on_token: Optional[Callable[[int], None]] = None,
                 eos_id: Optional[int] = None) -> list[int]:
        """Up to `max_new_tokens` new tokens; generation stops after `eos_id` (which is returned)."""
        if isinstance(prompt, (str, bytes)):
            raise UsageError(f"prompt must be a list of token ids, got a {type(prompt).__name__} "
                             "(encode text first, e.g. with k31c.tokenizer.ByteTokenizer)")
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        _positive_int("max_new_tokens", max_new_tokens)
        check_sampling(temperature, top_p)
        if not _is_int(seed) or not 0 <= seed <= SEED_MAX:
            raise UsageError(f"seed must be an integer in 0..{SEED_MAX} (64 bits), got {seed!r}")
        self._check_length(len(prompt) + max_new_tokens)
        gen = torch.Generator().manual_seed(seed)
        rid = self.add_request()
        out: list[int] = []
        try:
            logits = self.prefill([rid], [list(prompt)], logits="last")[0]
            while True:
                tok = sample(logits, temperature, top_p, gen)
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
                if len(out) == max_new_tokens or tok == eos_id:
                    return out
                logits = self.decode([rid], [tok])[0]
        finally:
            self.free(rid)

    def _check_length(self, n: int) -> None:
        if n > self.max_seq_len:
            raise ValueError(f"{n} tokens exceed the maximum length {self.max_seq_len}")


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise temperature + nucleus sampling on the CPU generator.
    NaN or inf logits raise NonFiniteLogits (argmax or multinomial would pick garbage or fail)."""
    check_sampling(temperature, top_p)
    logits = logits.float().cpu()
    if not torch.isfinite(logits).all():   # on the host already: no extra device sync
        raise NonFiniteLogits("the model's logits are NaN or inf")
    if temperature == 0:
        return int(logits.argmax())
    # shifted first: the largest becomes 0, so a small temperature gives -inf, never inf - inf
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < top_p
    keep[0] = True   # the most likely token, also when top_p underflows float32 (1e-300 -> 0)
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
    return int(order[choice])


def _device(device) -> torch.device:
    """`device` as a torch.device this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r}: this machine has no CUDA device (or torch was built "
                             "without CUDA)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                             "device(s)")
    return dev
