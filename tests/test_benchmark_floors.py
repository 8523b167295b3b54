"""The benchmarks' floor arithmetic reproduces spec/performance.md §6's floor table (no GPU:
the floors are computed from a Machine with the spec's bandwidth and matrix rate)."""
import pytest

from benchmarks.bench_layer import layer_floor_ms
from benchmarks.harness import Machine

SPEC = Machine(copy_gbps=4300.0, bf16_tflops=989.0, fp8_tflops=None, name="spec §6")
# L -> (sparse layer floor fused, with the fp32 logits round trip), in us (§6 (b) table)
TABLE = {16 << 10: (36, 38), 32 << 10: (44, 48), 128 << 10: (92, 108), 256 << 10: (156, 188),
         1 << 20: (543, 668)}


@pytest.mark.parametrize("ctx", sorted(TABLE))
def test_sparse_layer_floor_matches_spec_table(ctx):
    fused, unfused = TABLE[ctx]
    assert layer_floor_ms(ctx, SPEC) * 1e3 == pytest.approx(fused, abs=1.0)
    assert layer_floor_ms(ctx, SPEC, logits=True) * 1e3 == pytest.approx(unfused, abs=1.0)
