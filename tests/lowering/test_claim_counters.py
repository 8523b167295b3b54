"""The indexer scans' claim counters (claim_counters.py): one zeroed buffer a device, reused while
it holds the tiles asked for, replaced by a bigger one (the old kept: captured graphs hold its
address) when more are asked for. On the CPU (a cpu device stands in); the kernels' side (each
launch leaves the counters zeroed, call after call and graph-replayed) is
test_triton_indexer.py's test_warp_specialized_claims_leave_the_counters_zeroed, and the refusal
inside a capture is a GPU matter too."""
import torch

from k31c.lowering.triton import claim_counters as cc


def test_one_buffer_a_device_grown_by_replacement(monkeypatch):
    monkeypatch.setattr(cc, "_BUFFERS", {})
    monkeypatch.setattr(cc, "_RETIRED", [])
    cpu = torch.device("cpu")
    first = cc.counters(cpu, 3)
    assert first.dtype == torch.int32 and first.numel() == cc.MIN_TILES * cc.WORDS
    assert int(first.count_nonzero()) == 0
    assert cc.counters(cpu, cc.MIN_TILES) is first            # still holds them: the same buffer
    bigger = cc.counters(cpu, cc.MIN_TILES + 1)
    assert bigger is not first and bigger.numel() == (cc.MIN_TILES + 1) * cc.WORDS
    assert int(bigger.count_nonzero()) == 0
    assert len(cc._RETIRED) == 1 and cc._RETIRED[0] is first    # never freed
    assert cc.counters(cpu, 5) is bigger
