"""The top-k plan's filter threshold from its sample of a row's scores (`topk._plan_kernel`): a
key T with about `rank` sampled scores above it, by a value histogram where that lands close,
else the sampled key ranked `rank` exactly."""
from __future__ import annotations

import triton
import triton.language as tl

from k31c.lowering.triton.radix_select import (gather_live, live_slots, order_key, select_kth,
                                               threshold_by_value)


@triton.jit
def sample_threshold(x, rank, few_ptr, ctr_ptr, SAMPLES: tl.constexpr, GROUP: tl.constexpr, FEW: tl.constexpr,
                     PTX: tl.constexpr):
    """A key T with about `rank` of the sample's scores x above it: by a value histogram where
    it lands within rank / 8 (`threshold_by_value`: one histogram, where the exact select takes
    five digit levels or more), else the sample's key ranked `rank` exactly (`_ranked_key`)."""
    p, found = threshold_by_value(x, rank, SAMPLES)
    t = order_key(p)
    if found == 0:
        t = _ranked_key(order_key(x), rank, few_ptr, ctr_ptr, SAMPLES, GROUP, FEW, PTX)
    return t


@triton.jit
def _ranked_key(key, rank, few_ptr, ctr_ptr, SAMPLES: tl.constexpr, GROUP: tl.constexpr, FEW: tl.constexpr,
                PTX: tl.constexpr):
    """The sample's key ranked `rank` from the top (25 bits of it). The radix levels cost per key
    held, so a large sample is narrowed first: the rank-th largest of the maxima of groups of
    GROUP keys is a lower bound (at least `rank` keys reach it), and if at most FEW keys reach
    it, those are gathered (through `few_ptr`, slots counted at `ctr_ptr`) and selected from alone."""
    reach = tl.zeros_like(key) != 0
    n_reach = FEW + 1
    bound = tl.zeros((), tl.uint32)
    if SAMPLES // GROUP > 1:
        if rank <= SAMPLES // GROUP:
            peak = tl.max(tl.reshape(key, [SAMPLES // GROUP, GROUP], can_reorder=True), 1)  # any grouping bounds it
            bound, _, _ = select_kth(peak, tl.arange(0, SAMPLES // GROUP) < SAMPLES // GROUP, rank, 5)
            reach = key >= bound
            n_reach = tl.sum(reach.to(tl.int32), 0)
    if n_reach <= FEW:
        few, few_live = gather_live(key, reach, live_slots(reach, ctr_ptr, PTX), n_reach, few_ptr, FEW, PTX)
        t, _, _ = select_kth(few, few_live, rank, 5)
        # an exact t is a digit boundary: exactly `rank` of the few reach it, but keys below the
        # bound might too; no key below the bound is in the top `rank`, so t rises to it
        t = tl.maximum(t, bound)
    else:
        t, _, _ = select_kth(key, tl.arange(0, SAMPLES) < SAMPLES, rank, 5)
    return t
