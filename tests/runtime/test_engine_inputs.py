"""The Engine's API refuses bad arguments with an error naming the argument and the value (not a
truncation, a silent default, or an error from deep inside torch), samples safely at extreme
settings, and refuses NaN / inf logits and a cache pool larger than the device's memory."""
import copy
import math

import pytest
import torch

from k31c.config import preset
from k31c.errors import RuntimeFailure, UsageError
from k31c.runtime.engine import Engine, NonFiniteLogits, sample
from k31c.runtime.kv import CachePool
from tiny_model import make_model


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_requests=1, max_seq_len=16)


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=[1.5]), "token ids must be integers, got 1.5"),
    (dict(prompt="hello"), "prompt must be a list of token ids, got a str"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a positive integer, got 2.5"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (dict(top_p=math.nan), "top_p must be in (0, 1], got nan"),
    (dict(seed=-1), "seed must be an integer in 0..18446744073709551615 (64 bits), got -1"),
    (dict(seed=2**70), f"got {2**70}"),
], ids=lambda v: str(v)[:40])
def test_generate_names_a_bad_argument(engine, kwargs, message):
    args = dict(prompt=[1, 2], max_new_tokens=2) | kwargs
    with pytest.raises(UsageError) as e:
        engine.generate(args.pop("prompt"), args.pop("max_new_tokens"), **args)
    assert message in str(e.value)
    assert engine.pool.requests == {} and len(engine.pool.free_slots) == 1   # nothing held


def test_unknown_request(engine):
    with pytest.raises(UsageError, match=r"no request 99 \(never added, or already freed\)"):
        engine.free(99)
    with pytest.raises(UsageError, match="no request 99"):
        engine.prefill([99], [[1]])


@pytest.mark.parametrize("args,kwargs,message", [
    (("ck",), {}, "model must be a K3.1 model (K31ForCausalLM) or what k31c.compile returns, got builtins.str"),
    ((), dict(max_seq_len=4097), "max_seq_len 4097 exceeds the model's maximum length 4096"),
    ((), dict(max_seq_len=0), "max_seq_len must be a positive integer, got 0"),
    ((), dict(max_requests=1.5), "max_requests must be a positive integer, got 1.5"),
    ((), dict(device="bogus"), "device 'bogus' is not a torch device"),
], ids=lambda v: str(v)[:30])
def test_engine_names_a_bad_argument(model, args, kwargs, message):
    with pytest.raises(UsageError) as e:
        Engine(*(args or (model,)), **kwargs)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_engine_on_a_missing_cuda_device(model):
    with pytest.raises(UsageError, match="device 'cuda': this machine has no CUDA device"):
        Engine(model, max_requests=1, max_seq_len=16, device="cuda")


def test_sampling_keeps_the_top_token_at_extreme_settings():
    logits, gen = torch.tensor([0.0, 1.0, 3.0, 2.0]), torch.Generator().manual_seed(0)
    # top_p 1e-300 is 0 in float32; a temperature of 1e-30 overflows logits / T
    assert [sample(logits, 1.0, 1e-300, gen) for _ in range(5)] == [2] * 5
    assert [sample(logits, 1e-30, 1.0, gen) for _ in range(5)] == [2] * 5


def test_tiny_top_p_generates_the_greedy_tokens(engine):
    greedy = engine.generate([1, 2], 4)
    assert engine.generate([1, 2], 4, temperature=1.0, top_p=1e-300, seed=3) == greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_refused(model, temperature):
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.lm_head.weight.fill_(math.nan)
    eng = Engine(bad, max_requests=1, max_seq_len=16)
    with pytest.raises(NonFiniteLogits, match="the model's logits are NaN or inf"):
        eng.generate([1, 2], 2, temperature=temperature)
    assert eng.pool.requests == {}


def test_pool_larger_than_the_device_memory_is_refused_by_its_size():
    with pytest.raises(RuntimeFailure, match=r"out of memory: the cache pool for 1 request\(s\) of up "
                                             r"to 1099511627776 tokens needs \d+ bytes"):
        CachePool(preset("tiny"), max_requests=1, max_seq_len=2**40)


def test_run_once_runs_each_step_on_a_request_it_frees(model):
    """`Engine.run_once` (what `prebuild` runs on a GPU): each step once, prefill at 7 and 16
    tokens, a verification of R rows as one step of R rows; lengths capped by max_seq_len (a
    verification longer than a request skipped); the throwaway request freed after each."""
    calls = []

    def step_fn(ids, meta, caches, mode="prefill", rows=1):
        calls.append((mode, rows, ids.numel(), meta.row_len.tolist()))
        return model(ids, meta, caches, mode, rows)
    eng = Engine(model, max_requests=1, max_seq_len=12, step_fn=step_fn)
    eng.run_once([("prefill", 1), ("decode", 1), ("decode", 4), ("decode", 16)])
    assert calls == [("prefill", 1, 7, list(range(1, 8))), ("prefill", 1, 12, list(range(1, 13))),
                     ("decode", 1, 1, [1]), ("decode", 4, 4, [1, 2, 3, 4])]
    rid = eng.add_request()              # the one request slot is free again
    assert eng.length(rid) == 0
