"""The device-timeline arithmetic of `k31c bench e2e` and benchmarks/step_timeline.py on made-up
nodes (no GPU): the steady window, the union of busy time with overlapping streams, the table a step."""
import pytest

from benchmarks.timeline import idle_gaps, per_step, steady_steps


def _node(ts, dur, name, stream=7):
    return dict(ts=float(ts), dur=float(dur), name=name, stream=stream, cat="kernel")


def test_steady_window_busy_and_table():
    # step 0 waits for the host (a long gap), steps 1 and 2 are steady; each ends with its logits copy
    nodes = [_node(0, 2, "copy"), _node(50, 10, "gemv"), _node(61, 1, "Memcpy DtoD"),
             _node(65, 2, "copy"), _node(68, 10, "gemv"), _node(70, 6, "side", stream=8),
             _node(79, 1, "Memcpy DtoD"),
             _node(82, 2, "copy"), _node(85, 10, "gemv"), _node(96, 1, "Memcpy DtoD")]
    window, steps = steady_steps(nodes)
    assert steps == 2 and window[0]["ts"] == 65 and window[-1]["ts"] == 96
    span, busy, before = idle_gaps(window)
    # busy: [65,67] [68,78] (the side stream's [70,76] inside it) [79,80] [82,84] [85,95] [96,97]
    assert span == pytest.approx(32) and busy == pytest.approx(26)
    assert before == pytest.approx([0, 1, 0, 1, 2, 1, 1])
    table = per_step(window, steps)
    assert table[0] == ("gemv", pytest.approx(10.0), pytest.approx(1.0))
    assert dict((n, c) for n, _, c in table)["side"] == pytest.approx(0.5)


def test_a_window_needs_two_step_ends():
    with pytest.raises(ValueError, match="fewer than two steps"):
        steady_steps([_node(0, 1, "gemv"), _node(2, 1, "Memcpy DtoD")])
