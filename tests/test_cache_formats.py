"""Cache formats end to end on the tiny model: FP8 latent rows (CachePool(latent_cache="fp8")) and
MXFP8 index keys (index_cache="mxfp8"), chosen through k31c.compile's quantize options, run by the
CPU path (reference ops) and by the h200 program's Triton kernels under the interpreter."""
import pytest
import torch

import k31c.api as k31c_api
from k31c.errors import UsageError
from k31c.runtime.engine import Engine
from tiny_model import close, engine_scenario, make_model  # noqa: F401

FORMATS = {"quantize": {"latent_cache": "fp8", "mxfp8_indexer": True}}


def _scenario(model, step_fn=None, **kw):
    return engine_scenario(model, step_fn, [(0, 40), (40, 70)], 100, [0, 1], 4, **kw)


def _short(model, **kw):
    """Prefill (past top-k, so the indexer selects) and two decode steps: two step kinds to build."""
    eng = Engine(model, max_requests=2, max_seq_len=64, **kw)
    rids = [eng.add_request() for _ in range(2)]
    out = [eng.prefill(rids, [list(range(3, 26)), list(range(40, 47))])]
    for i in range(2):
        out.append(eng.decode(rids, [7 + i, 9 + i]))
    return torch.cat(out)


def _rel_rms(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fp8_latent_logit_error_against_the_float_cache():
    """Logits of the tiny model (the spec's init: AttnRes projections zero) over an engine run
    (prefill, decode, verification) with FP8 latent rows vs the model-dtype (fp32) cache. Measured
    relative RMS: 2.0e-2 (a bf16 latent cache: 3.5e-4); the band's lower end shows the rows really
    are quantised."""
    model = make_model(res_std=0.0)
    base = _scenario(model)
    fp8 = _scenario(model, latent_cache="fp8")
    assert 5e-3 < _rel_rms(fp8, base) < 4e-2, _rel_rms(fp8, base)
    assert (fp8.argmax(-1) == base.argmax(-1)).float().mean() > 0.9


def test_compile_options_choose_the_pool_formats():
    """options={"quantize": {"latent_cache": "fp8", "mxfp8_indexer": True}}: Engine(compiled)
    allocates the FP8 latent / MXFP8 index pool, the report records the formats, and the compiled
    run equals the eager model on the same formats."""
    model = make_model()
    compiled = k31c_api.compile(model, target="cpu", options={"executor": "fx", **FORMATS})
    assert compiled.cache_formats == {"latent_cache": "fp8", "index_cache": "mxfp8"}
    eng = Engine(compiled, max_requests=2, max_seq_len=64)
    assert eng.pool.mla[0].latent.dtype == torch.uint8 and eng.pool.mla[0].index.dtype == torch.float8_e4m3fn
    close(_short(compiled), _short(model, latent_cache="fp8", index_cache="mxfp8"), tol=1e-4)
    text = str(compiled.report)
    assert "latent cache: fp8" in text and "index cache: mxfp8" in text
    assert "by the ops on the MXFP8 index cache" in text


def test_a_pool_in_another_format_is_an_error_naming_the_fix():
    model = make_model()
    compiled = k31c_api.compile(model, target="cpu", options={"executor": "fx",
                                                              "quantize": {"latent_cache": "fp8"}})
    with pytest.raises(UsageError, match=r"latent_cache='fp8'.*CachePool"):
        _short(compiled, latent_cache="model")
    compiled = k31c_api.compile(model, options={"executor": "fx", "quantize": {"latent_cache": "fp4"}})
    with pytest.raises((UsageError, ValueError), match="latent_cache must be one of"):   # pool or pass
        _short(compiled)


def test_the_index_cache_option_chooses_fp8_keys():
    """options={"quantize": {"index_cache": "fp8"}}: Engine(compiled) allocates FP8 index keys
    (uint8, 132 B a token's 128 values) and the compiled run equals the eager model on that pool;
    a pool of float keys under it, or a second index format beside mxfp8_indexer, is a UsageError
    naming the fix; an unknown format names the choices."""
    model = make_model(index_head_dim=128)

    def compiled(**quantize):
        return k31c_api.compile(model, target="cpu", options={"executor": "fx", "quantize": quantize})
    fp8 = compiled(index_cache="fp8")
    assert fp8.cache_formats == {"index_cache": "fp8"}
    eng = Engine(fp8, max_requests=2, max_seq_len=64)
    assert eng.pool.mla[0].index.dtype == torch.uint8
    close(_short(fp8), _short(model, index_cache="fp8"), tol=1e-4)
    assert "index cache: fp8" in str(fp8.report)
    with pytest.raises(UsageError, match=r"index_cache='fp8'.*CachePool\(\.\.\., index_cache='fp8'\)"):
        _short(compiled(index_cache="fp8"), index_cache="bf16")
    with pytest.raises(UsageError, match="mxfp8_indexer"):
        _short(compiled(index_cache="fp8", mxfp8_indexer=True))
    with pytest.raises((UsageError, ValueError), match="index_cache must be one of"):   # pool or pass
        _short(compiled(index_cache="int4"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run of the GPU program")
def test_h200_program_on_fp8_latent_and_mxfp8_index_caches():
    """The h200 program (Triton kernels under the interpreter) on the 8-bit pools: every op runs a
    kernel (FP8 latent write, sparse MLA dequantising on chip, MXFP8 key write and scan) and the
    logits match the eager model on the same pools."""
    model = make_model()
    compiled = k31c_api.compile(model, target="h200", options={"dense_codegen": "fx", **FORMATS})
    # the program's projections (linear_group) round differently from eager's by ulps, which
    # moves a few latent values and index keys across an e4m3 step: 7.7e-4 measured
    close(_short(compiled), _short(model, latent_cache="fp8", index_cache="mxfp8"), tol=1e-3)
    for step in ("prefill", "decode"):
        report = compiled.report.steps[step]
        assert report.fallbacks == {} and all(k.startswith("triton:") for _, k in report.kernels)
