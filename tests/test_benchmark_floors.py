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


@pytest.mark.parametrize("copy_gbps, g0, other", [(4116.0, "met", "missed"), (2983.0, "missed", "void (G0 missed)")])
def test_a_run_below_g0_copy_bandwidth_voids_its_goal_verdicts(monkeypatch, capsys, copy_gbps, g0, other):
    """Spec §8 G0: a run whose copy bandwidth is under 4.0 TB/s is discarded, so the goals it
    measured are reported void, not met or missed, and its table says why."""
    from benchmarks import harness
    monkeypatch.setattr(harness, "GOALS", [])
    m = Machine(copy_gbps=copy_gbps, bf16_tflops=780.0, fp8_tflops=None, name="a card")
    harness.record_sanity(m)
    harness.record_goal("G2 top-k 64x128K", "<= 30 us", "32.4 us", False)
    rows = [line.split(" | ")[-1].rstrip(" |") for line in harness.goals_markdown().splitlines()[2:]]
    assert rows == [g0, other]
    assert capsys.readouterr().out.splitlines()[-1].endswith(other)
    header = harness.markdown([], m).splitlines()[0]
    assert ("no spec §8 goal is judged" in header) == (g0 == "missed")
