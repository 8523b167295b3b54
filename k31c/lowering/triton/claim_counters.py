"""Claim counters of the warp-specialized indexer scans (indexer_ws, indexer_ws_filter).

A tile's programs take chunks of its blocks from a counter of the tile's, so a program on a
slower SM takes fewer and the tile's programs end together. The counters must read zero when a
launch starts; every launch leaves them zero (the tile's last program to finish zeroes its
words). So one zeroed buffer a device serves every launch, as long as the device's scans run
one at a time: k31c's programs run them in stream order on one stream (the stream regions hold
the indexer's prolog, not its scans), and the kernels' PDL forms wait for the kernel before
them before they claim. Two scans running at once on two streams of one device would share the
counters; nothing in k31c does that.

A buffer is allocated once (outside any CUDA graph capture: captured graphs hold its address),
grown by replacement when more tiles are asked for, and never freed.
"""
from __future__ import annotations

import torch

WORDS = 8            # int32 words a tile: a claim counter per pass (4 rows: at most 4), a done counter
MIN_TILES = 256      # the smallest buffer, so that most programs never grow it

_BUFFERS: dict = {}
_RETIRED: list = []  # replaced buffers, still referenced by graphs captured with them


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed counters (int32, at least tiles * WORDS) for launches on `device`. The first
    call for a device, or for more tiles than its buffer holds, allocates, and must not run
    inside a graph capture (run the call once before capturing)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    buf = _BUFFERS.get(dev)
    if buf is None or buf.numel() < tiles * WORDS:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"indexer scan: claim counters for {tiles} tiles first asked for inside a CUDA graph "
                "capture; run the call once before capturing")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, MIN_TILES) * WORDS, dtype=torch.int32, device=device)
        _BUFFERS[dev] = buf
    return buf
