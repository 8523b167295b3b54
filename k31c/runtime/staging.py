"""A device-graph bucket's per-step inputs: static device buffers, filled from a host staging
buffer by the graph's own first node (lowering/triton/stage.py).

`fill` writes a step's token ids and metadata (host tensors, as the Engine passes them) into the
staging buffer, with padding in the rows past the batch (rows a larger batch filled before are
padded again); the block table is shipped as the entries that changed since the last step (a
request gains a block every block_size tokens), or, past the pairs' capacity (the batch's
requests changed), copied whole before the replay. Inputs already on the device go the same way
without a host wait: their rows are copied into the (pinned) staging buffer by copies queued on
the stream ahead of the replay, and a device block table is copied whole on the device (the host
never learns its entries, so the next host table is copied whole too). `stage` is the kernel
the graph captures. The host may overwrite the staging buffer only once the previous replay has
read it: `fill` waits on an event the graph records right after staging, that is, until the
previous step has started on the device, so the host stays a step ahead.

Verification snapshots are per-step inputs written by the step; they are not staged and are
copied back after the replay (`copy_back`).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ..errors import RuntimeFailure
from ..lowering.triton.stage import stage_words

TABLE = "meta.block_table"


@dataclass
class StepInputs:
    """Where a step kind's per-step inputs sit among the program inputs, and their shapes."""
    per_step: list[int]                 # program input index of each per-step tensor
    names: list[str]
    shapes: list[tuple]                 # symbolic shapes (sympy expressions in the batch symbol)
    snapshots: list[int]                # the subset of per_step written by the step (copied back)
    batch_symbol: sympy.Symbol
    rows: int


def decode_step_inputs(captured, placeholders: list, rows: int) -> StepInputs:
    """The per-step inputs of a captured decode step (`placeholders`: its graph's, in order):
    token ids, metadata and snapshots."""
    batch = next(sympy.Symbol(s, integer=True, positive=True) for s, label in captured.dims.items()
                 if label == "B")
    per_step, names, shapes, snaps = [], [], [], []
    for i, (node, info) in enumerate(zip(placeholders, captured.inputs)):
        if info.is_weight or not (info.name == "input_ids" or info.name.startswith("meta.")
                                  or info.name.startswith("caches.kda_snapshots")):
            continue
        per_step.append(i)
        names.append(info.name)
        shape = []
        for d in node.meta["val"].shape:
            if isinstance(d, torch.SymInt):
                expr = d.node.expr
                sym = next(iter(expr.free_symbols))
                shape.append(expr.xreplace({sym: batch}))
            else:
                shape.append(d)
        shapes.append(tuple(shape))
        if info.name.startswith("caches.kda_snapshots"):
            snaps.append(i)
    return StepInputs(per_step, names, shapes, snaps, batch, rows)


def _words(t: torch.Tensor) -> int:
    if t.element_size() not in (4, 8):
        raise RuntimeFailure(f"device graphs: staged inputs are 32- or 64-bit integers, got {t.dtype}")
    return t.numel() * t.element_size() // 4


class StagedInputs:
    def __init__(self, inputs: StepInputs, templates: list[torch.Tensor], device: torch.device):
        """`templates`: each per-step input's padding at the bucket's batch (snapshots: the
        buffers the step writes)."""
        self.inputs = inputs
        cuda = device.type == "cuda"
        self.table_index = inputs.names.index(TABLE) if TABLE in inputs.names else None
        staged = [i for i, index in enumerate(inputs.per_step)
                  if index not in inputs.snapshots and i != self.table_index]
        offsets, n = {}, 0
        for i in staged:
            n += n % 2                                   # 64-bit inputs at 8-byte offsets
            offsets[i] = n
            n += _words(templates[i])
        n += n % 2
        self.n_dense = n
        self.dense = torch.empty(n, dtype=torch.int32, device=device)
        if self.table_index is not None:
            table = templates[self.table_index]
            self.table = table.clone()
            self.shadow = table.cpu().clone()            # what the device table holds once staged
            self.capacity = table.shape[0] * (inputs.rows + 1)   # new blocks a decode step can add
        else:                                            # a one-word stand-in: no null pointer
            self.table = torch.full((1,), -1, dtype=torch.int32, device=device)
            self.shadow, self.capacity = None, 0
        self.host = torch.empty(n + 2 * self.capacity, dtype=torch.int32, pin_memory=cuda)
        self.host[n:] = -1
        # zero-copy needs the pinned buffer mapped into the device's address space (CUDA's unified
        # addressing); under ROCm the graph copies it to the device first
        hip = cuda and torch.version.hip is not None
        self.src = torch.empty_like(self.host, device=device) if hip else self.host
        self.buffers, self.host_views, self.padding = [], [], []
        for i, t in enumerate(templates):
            if i in offsets:
                o, w = offsets[i], _words(t)
                self.buffers.append(self.dense[o:o + w].view(t.dtype).view(t.shape))
                self.host_views.append(self.host[o:o + w].view(t.dtype).view(t.shape))
                self.host_views[-1].copy_(t)
                self.padding.append(t.cpu())
            else:
                self.buffers.append(self.table if i == self.table_index else t)
                self.host_views.append(None)
                self.padding.append(None)
        self.dense.copy_(self.host[:n])
        self.filled = [0] * len(templates)
        self.table_rows = 0
        self.pairs = 0                                   # pairs written by the last fill
        self.shadow_known = True                         # False after a device table: not in shadow
        self.staged = torch.cuda.Event(external=True) if cuda else None

    def bind(self, flat: list) -> list:
        """`flat` with the per-step inputs replaced by the buffers."""
        run = list(flat)
        for index, t in zip(self.inputs.per_step, self.buffers):
            run[index] = t
        return run

    def stage(self) -> None:
        """The graph's first node: the staging buffer into the static buffers."""
        if self.src is not self.host:
            self.src.copy_(self.host, non_blocking=True)
        stage_words(self.src, self.dense, self.table.view(-1))

    def fill(self, flat: list) -> bool:
        """The step's inputs into the staging buffer (after the previous replay has read it).
        True when the block table was copied whole."""
        if self.staged is not None:
            self.staged.synchronize()
        for i, index in enumerate(self.inputs.per_step):
            view = self.host_views[i]
            if view is None:
                continue
            t = flat[index]
            n = t.shape[0]
            view[:n].copy_(t, non_blocking=t.is_cuda)    # device rows: queued before the replay
            if self.filled[i] > n:
                view[n:self.filled[i]].copy_(self.padding[i][n:self.filled[i]])
            self.filled[i] = n
        if self.table_index is None:
            return False
        rows = flat[self.inputs.per_step[self.table_index]]
        if rows.is_cuda:
            return self._copy_device_table(rows)
        return self._fill_table(rows)

    def _copy_device_table(self, rows: torch.Tensor) -> bool:
        n = rows.shape[0]
        self.table[:n].copy_(rows, non_blocking=True)
        self.table[n:max(n, self.table_rows)].fill_(-1)
        self._clear_pairs(0)
        self.table_rows = n
        self.shadow_known = False
        return True

    def _fill_table(self, rows: torch.Tensor) -> bool:
        n = rows.shape[0]
        # every row when a device table came last (its entries are not in shadow)
        upto = max(n, self.table_rows) if self.shadow_known else self.table.shape[0]
        want = rows if upto == n else torch.cat(
            [rows, torch.full((upto - n, rows.shape[1]), -1, dtype=rows.dtype)])
        old = self.shadow[:upto]
        changed = (old != want).view(-1).nonzero().squeeze(1)
        pairs = self.host[self.n_dense:].view(-1, 2)
        # copied whole when the batch's requests changed (more entries than pairs) or unknown
        whole = changed.numel() > self.capacity or not self.shadow_known
        k = 0 if whole else changed.numel()
        if whole:
            self.table[:upto].copy_(want.pin_memory() if self.table.is_cuda else want, non_blocking=True)
        else:
            pairs[:k, 0] = changed.to(torch.int32)
            pairs[:k, 1] = want.view(-1)[changed]
        self._clear_pairs(k)
        old.copy_(want)
        self.table_rows = n
        self.shadow_known = True
        return whole

    def _clear_pairs(self, k: int) -> None:
        """Mark the pairs from k on (written by an earlier fill) as empty."""
        if self.pairs > k:
            self.host[self.n_dense:].view(-1, 2)[k:self.pairs, 0] = -1
        self.pairs = k

    def copy_back(self, flat: list, batch: int) -> None:
        """The step's snapshots of the first `batch` requests into the caller's tensors."""
        for index, static in zip(self.inputs.per_step, self.buffers):
            if index in self.inputs.snapshots:
                flat[index].copy_(static[:batch])
