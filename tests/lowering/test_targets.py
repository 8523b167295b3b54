"""The Target records: every target fact in one place, read by the registry, the launchers (through
triton/device.py), the AOT build and the lower pass."""
import dataclasses

import pytest
import torch

from k31c.lowering.aot import default_shapes
from k31c.lowering.registry import kernels_for
from k31c.lowering.targets import GPU_TARGETS, TARGETS, get_target
from k31c.lowering.triton import device


def test_gpu_targets_are_the_records_with_a_triton_backend():
    assert GPU_TARGETS == ("h200", "mi350x")
    assert all(get_target(n).triton_backend for n in GPU_TARGETS)
    assert get_target("cpu").triton_backend is None and "cpu" not in GPU_TARGETS
    with pytest.raises(ValueError, match="unknown target 'b300'"):
        get_target("b300")


def test_target_facts():
    h200, mi350x, cpu = (get_target(n) for n in ("h200", "mi350x", "cpu"))
    assert (h200.sm_count, mi350x.sm_count) == (132, 256)
    assert (h200.warp_size, mi350x.warp_size) == (32, 64)
    assert (h200.dense_codegen, mi350x.dense_codegen, cpu.dense_codegen) == ("inductor", "iree", "inductor")
    assert (h200.graph_streams, mi350x.graph_streams) == (3, 1)      # HIP: single-stream capture
    assert h200.device_graphs and mi350x.device_graphs and not cpu.device_graphs
    assert h200.dot_precision(fast=True) == "tf32" and mi350x.dot_precision(fast=True) == "ieee"
    assert h200.dot_precision(fast=False) == "ieee"
    assert h200.variant("k31c::lightning_indexer", "gather") == "warp_specialized"
    assert cpu.variant("k31c::lightning_indexer", "gather") == "gather"   # no record: the launcher's


def test_every_triton_kernel_registers_for_every_gpu_target():
    ops = {n: set(kernels_for(n)) for n in GPU_TARGETS}
    assert ops["h200"] == ops["mi350x"] and len(ops["h200"]) == 14
    assert kernels_for("cpu") == {}


def test_aot_shapes_carry_the_target():
    for name in GPU_TARGETS:
        shapes = default_shapes(name)
        assert shapes.target is TARGETS[name]


def test_launchers_take_the_current_devices_record():
    assert device.target_of(torch.device("cpu")) is get_target("cpu")
    assert device.sm_count(torch.device("cpu")) == get_target("cpu").sm_count
    other = dataclasses.replace(get_target("cpu"), sm_count=7)
    with device.using_target(other):
        assert device.sm_count(torch.device("cpu")) == 7
        assert device.target_of(torch.device("meta")) is get_target("cpu")   # not its device type
    assert device.target_of(torch.device("cpu")) is get_target("cpu")


def test_a_gpu_is_matched_by_name_else_its_backends_first_target(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    names = {0: "NVIDIA H200", 1: "NVIDIA B200", 2: "AMD Instinct MI350X"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    device._gpu_target.cache_clear()
    try:
        assert device.target_of(torch.device("cuda", 0)).name == "h200"
        assert device.target_of(torch.device("cuda", 1)).name == "h200"     # unknown: CUDA's first
        monkeypatch.setattr(torch.version, "hip", "6.4")
        device._gpu_target.cache_clear()
        assert device.target_of(torch.device("cuda", 2)).name == "mi350x"
        assert device.target_of(torch.device("cuda", 1)).name == "mi350x"   # ROCm's first
    finally:
        device._gpu_target.cache_clear()


def test_pdl_launch_arguments_follow_the_record_and_the_device(monkeypatch):
    """Programmatic dependent launch: the kernels' PDL flag and Triton's launch_pdl only when the
    record in force has `pdl`, on CUDA sm_90+, compiled (not interpreted); else no arguments."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(device, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    capability = {0: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability[i])
    device._sm90.cache_clear()
    on = dataclasses.replace(get_target("h200"), pdl=True)
    try:
        with device.using_target(on):
            assert device.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
            assert device.pdl_launch(torch.device("cpu")) == {}          # the record is for CUDA
        with device.using_target(get_target("h200")):                   # h200's default: off
            assert device.pdl_launch(cuda) == {}
        capability[0] = (8, 0)                                           # an A100 has no griddepcontrol
        device._sm90.cache_clear()
        with device.using_target(on):
            assert device.pdl_launch(cuda) == {}
        monkeypatch.setattr(device, "interpreting", lambda: True)
        with device.using_target(on):
            assert device.pdl_launch(cuda) == {}
    finally:
        device._sm90.cache_clear()


def test_register_cap_only_where_triton_takes_one(monkeypatch):
    """A launcher's register cap becomes Triton's maxnreg on compiled CUDA launches only: the
    interpreter and ROCm (whose backend would refuse the keyword) get none, nor does cap 0/None."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(device, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert device.register_cap(cuda, 168) == {"maxnreg": 168}
    assert device.register_cap(cuda, 0) == {} and device.register_cap(cuda, None) == {}
    assert device.register_cap(torch.device("cpu"), 168) == {}
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert device.register_cap(cuda, 168) == {}
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(device, "interpreting", lambda: True)
    assert device.register_cap(cuda, 168) == {}


def test_kda_prefill_chunk_is_the_targets_else_the_models():
    from k31c.lowering.triton import kda_prefill as kp
    assert kp.kernel_chunk(get_target("h200"), 64) == 16
    assert kp.kernel_chunk(get_target("mi350x"), 64) == 64 and kp.kernel_chunk(get_target("cpu"), 32) == 32
    # (the AOT build's kernels at each target's chunk: test_aot.py)


def test_kda_prefill_launch_defaults_follow_the_target_and_the_chunk():
    from k31c.lowering.triton import kda_prefill as kp
    h200, mi350x = get_target("h200"), get_target("mi350x")
    p = kp.plan(h200, 2, 16, 128, 4, torch.bfloat16, -5.0)       # one-block chunks: V split
    assert (p.state_stages, p.chunk_stages, p.state_warps, p.block_v) == (4, 2, 4, 64)
    p = kp.plan(h200, 2, 64, 128, 4, torch.bfloat16, -5.0)
    assert (p.state_stages, p.chunk_stages, p.state_warps, p.block_v) == (2, 2, 8, 128)
    p = kp.plan(mi350x, 2, 16, 128, 4, torch.bfloat16, -5.0)     # too little shared memory
    assert (p.state_stages, p.chunk_stages, p.state_warps, p.block_v) == (1, None, 8, 128)
    p = kp.plan(h200, 2, 16, 32, 4, torch.bfloat16, -5.0, block_v=None, state_warps=8)
    assert (p.block_v, p.state_warps) == (32, 8)                   # None: the target's; BV <= K
    with pytest.raises(TypeError, match="block_w"):
        kp.plan(h200, 2, 16, 128, 4, torch.bfloat16, -5.0, block_w=64)
