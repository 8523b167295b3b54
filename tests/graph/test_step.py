"""graph/step.py: the hand-written flatten equals pytree's (the order of a graph's step inputs),
and padding requests have the shapes and values a device-graph bucket pads with."""
import torch
import torch.utils._pytree as pytree

from k31c.config import preset
from k31c.graph.step import padding_step, step_leaves
from k31c.runtime.kv import CachePool


def test_step_leaves_follow_pytree_order():
    pool = CachePool(preset("tiny"), max_requests=3, max_seq_len=64)
    ids, meta = padding_step(3, 2, pool.max_blocks_per_req, "cpu")
    for snaps in (None, pool.new_snapshots(3, 2)):
        args = (ids, meta, pool.caches(snaps))
        got, want = step_leaves(*args), pytree.tree_flatten(args)[0]
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_padding_step():
    ids, meta = padding_step(4, 3, 5, "cpu")
    assert ids.shape == (12,) and meta.block_table.shape == (4, 5)
    assert (meta.slot_mapping == -1).all() and (meta.row_len == 0).all() and (meta.kda_slots == -1).all()
    assert meta.row_req.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert meta.cu_seqlens.tolist() == [0, 3, 6, 9, 12] and (meta.block_table == -1).all()
    assert meta.row_req.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
