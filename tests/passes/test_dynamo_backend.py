"""`torch.compile(..., backend="k31c")`: Dynamo's graph goes through the same passes. The whole
tiny model's decode step is one graph (fullgraph: no breaks) and a second batch size reuses it."""
import copy

import pytest
import torch

import k31c.backend as k31c_backend
from pass_helpers import MLALayer, step_inputs, tiny_cfg
from k31c.config import preset
from k31c.graph.model import K31ForCausalLM
from k31c.runtime.engine import Engine


@pytest.fixture(scope="module")
def tiny_engine():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = K31ForCausalLM(cfg)
    model.reset_parameters(torch.Generator().manual_seed(0))
    model.eval()
    eng = Engine(model, max_requests=4, max_seq_len=128)
    rids = [eng.add_request() for _ in range(3)]
    eng.prefill(rids, [list(range(1, 30)), [7, 8, 9], [5] * 20])
    return model, eng, rids


def test_tiny_decode_is_one_graph_for_every_batch_size(tiny_engine):
    model, eng, rids = tiny_engine
    torch._dynamo.reset()
    before = len(k31c_backend.BACKEND_COMPILES)
    compiled = torch.compile(model, backend=k31c_backend.backend(options={"executor": "fx"}),
                             fullgraph=True, dynamic=True)
    for batch in (2, 3):
        ids, meta = eng._inputs(rids[:batch], [eng.length(r) for r in rids[:batch]], [1] * batch,
                                list(range(3, 3 + batch)))
        ours, theirs = copy.deepcopy(eng.pool.caches()), copy.deepcopy(eng.pool.caches())
        with torch.no_grad():
            got = compiled(ids, meta, ours, "decode", 1)
            ref = model(ids, meta, theirs, "decode", 1)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(ours.mla, theirs.mla):
            assert torch.equal(a.index, b.index)
    assert len(k31c_backend.BACKEND_COMPILES) == before + 1      # one graph, no retrace for batch 3
    passes = {r.name: r.result for r in k31c_backend.BACKEND_COMPILES[-1]["passes"]}
    assert passes["indexer_prolog"].matches == len(model.config.mla_layers)
    assert passes["fuse_index_write"].matches == len(model.config.mla_layers)


def test_registered_backend_name_runs_inductor_on_a_layer():
    cfg = tiny_cfg()
    layer = MLALayer(cfg).eval()
    torch._dynamo.reset()
    before = len(k31c_backend.BACKEND_COMPILES)
    compiled = torch.compile(layer, backend="k31c", fullgraph=True)
    x, meta, cache = step_inputs(cfg)
    ours = copy.deepcopy(cache)
    with torch.no_grad():
        ref = layer(x, meta, cache)
        got = compiled(x, meta, ours)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert torch.allclose(ours.index, cache.index, atol=1e-6)
    assert len(k31c_backend.BACKEND_COMPILES) == before + 1


@pytest.mark.parametrize("code", [
    # `import k31c` after Dynamo is loaded registers the backend
    "import torch._dynamo; import k31c; import torch._dynamo.backends.registry as r; "
    "print(r.lookup_backend('k31c').__module__)",
    # installed k31c: Dynamo finds it through the torch_dynamo_backends entry point, no import needed
    "import torch._dynamo.backends.registry as r; print(r.lookup_backend('k31c').__module__)",
])
def test_backend_name_is_found_without_importing_k31c_api(code):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "k31c"
