"""A device-graph bucket's staged inputs (runtime/staging.py) and the staging kernel, on CPU tensors
in the Triton interpreter: what `fill` + `stage` leave in the static buffers is the step's values
in the first rows and padding after them, and the block table equals the step's rows whether it
was shipped as changed entries or copied whole."""
import pytest
import sympy
import torch

from k31c.lowering.triton.stage import stage_words
from k31c.runtime.staging import StagedInputs, StepInputs

BUCKET, ROWS, MAX_BLOCKS = 4, 2, 6
# on a GPU machine: static buffers on the device, the staging buffer pinned and read zero-copy
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs() -> StepInputs:
    b = sympy.Symbol("B", integer=True, positive=True)
    names = ["input_ids", "meta.slot_mapping", "meta.block_table", "meta.row_len", "meta.cu_seqlens",
             "caches.kda_snapshots.0.conv"]
    shapes = [(b * ROWS,), (b * ROWS,), (b, MAX_BLOCKS), (b * ROWS,), (b + 1,), (b, ROWS, 3)]
    return StepInputs(per_step=[10, 11, 12, 13, 14, 20], names=names, shapes=shapes, snapshots=[20],
                      batch_symbol=b, rows=ROWS)


def _padding(batch: int) -> list[torch.Tensor]:
    n = batch * ROWS
    return [torch.zeros(n, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64),
            torch.full((batch, MAX_BLOCKS), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
            torch.arange(batch + 1, dtype=torch.int32) * ROWS, torch.empty(batch, ROWS, 3)]


def _step(batch: int, gen: torch.Generator, table=None) -> dict[int, torch.Tensor]:
    n = batch * ROWS
    if table is None:
        table = torch.randint(0, 1000, (batch, MAX_BLOCKS), generator=gen, dtype=torch.int32)
    return {10: torch.randint(0, 2**40, (n,), generator=gen),
            11: torch.randint(0, 2**40, (n,), generator=gen),
            12: table, 13: torch.randint(1, 500, (n,), generator=gen, dtype=torch.int32),
            14: torch.arange(batch + 1, dtype=torch.int32) * ROWS, 20: torch.zeros(batch, ROWS, 3)}


def _run(statics: StagedInputs, step: dict) -> bool:
    flat = [None] * 21
    for index, t in step.items():
        flat[index] = t
    whole = statics.fill(flat)
    statics.stage()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return whole


def _check(statics: StagedInputs, step: dict, batch: int) -> None:
    pad = _padding(BUCKET)
    for i, index in enumerate(statics.inputs.per_step[:5]):
        want = torch.cat([step[index], pad[i][step[index].shape[0]:]])
        assert torch.equal(statics.buffers[i].cpu(), want), statics.inputs.names[i]


def test_fill_and_stage_pad_the_rows_past_the_batch():
    gen = torch.Generator().manual_seed(0)
    statics = StagedInputs(_inputs(), [t.to(DEV) for t in _padding(BUCKET)], DEV)
    assert statics.capacity == BUCKET * (ROWS + 1)
    two = _step(2, gen, table=torch.full((2, MAX_BLOCKS), -1, dtype=torch.int32))
    two[12][:, :2] = torch.randint(0, 1000, (2, 2), generator=gen, dtype=torch.int32)
    assert not _run(statics, two)                    # 4 changed entries: shipped as pairs
    assert statics.pairs == 4
    _check(statics, two, 2)
    three = _step(3, gen)                            # 18 changed entries > 12: copied whole
    assert _run(statics, three)
    _check(statics, three, 3)
    one = _step(1, gen, table=three[12][:1].clone())
    one[12][0, 5] = 1001                             # one new block; rows 1 and 2 padded again
    assert _run(statics, one)                        # 1 + 12 entries back to -1 > 12: whole
    _check(statics, one, 1)
    grown = {**one, 12: one[12].clone()}
    grown[12][0, 4] = 1002
    assert not _run(statics, grown) and statics.pairs == 1
    _check(statics, grown, 1)


def test_stale_pairs_are_cleared():
    """A step shipped as pairs, then one copied whole that sets an entry the pairs wrote: the old
    pairs must not be applied again."""
    gen = torch.Generator().manual_seed(1)
    statics = StagedInputs(_inputs(), [t.to(DEV) for t in _padding(BUCKET)], DEV)
    first = _step(2, gen, table=torch.full((2, MAX_BLOCKS), -1, dtype=torch.int32))
    first[12][0, 0] = 11
    assert not _run(statics, first)
    second = _step(4, gen)
    second[12][0, 0] = 12
    assert _run(statics, second)
    _check(statics, second, 4)
    assert statics.table[0, 0].item() == 12


@pytest.mark.skipif(DEV.type != "cuda", reason="device inputs need a CUDA device")
def test_device_inputs_interleave_with_host_inputs():
    """Inputs already on the device: their rows are copied in on the stream and the block table is
    copied whole; the next host step, one entry away from it, is copied whole too (the host never
    saw the device table's entries), and the step after it is shipped as pairs again."""
    gen = torch.Generator().manual_seed(3)
    statics = StagedInputs(_inputs(), [t.to(DEV) for t in _padding(BUCKET)], DEV)
    assert _run(statics, _step(3, gen))
    dev = _step(2, gen)
    assert _run(statics, {i: t.to(DEV) for i, t in dev.items()})
    assert statics.pairs == 0
    _check(statics, dev, 2)                          # row 2 of the 3-request step padded again
    host = {**dev, 12: dev[12].clone()}
    host[12][1, 3] = 1003
    assert _run(statics, host)
    _check(statics, host, 2)
    grown = {**host, 12: host[12].clone()}
    grown[12][0, 2] = 1004
    assert not _run(statics, grown) and statics.pairs == 1
    _check(statics, grown, 2)


def test_stage_words_against_indexing():
    gen = torch.Generator().manual_seed(2)
    dense = torch.empty(37, dtype=torch.int32, device=DEV)
    table = torch.randint(-5, 5, (5, 9), generator=gen, dtype=torch.int32)
    idx = torch.randperm(45, generator=gen)[:6].to(torch.int32)
    idx[2] = -1
    vals = torch.randint(-2**31, 2**31 - 1, (6,), generator=gen, dtype=torch.int32)
    src = torch.cat([torch.randint(-2**31, 2**31 - 1, (37,), generator=gen, dtype=torch.int32),
                     torch.stack([idx, vals], 1).reshape(-1)])
    want = table.clone().view(-1)
    keep = idx >= 0
    want[idx[keep].long()] = vals[keep]
    if DEV.type == "cuda":
        src, table = src.pin_memory(), table.to(DEV)
    stage_words(src, dense, table.view(-1))
    assert torch.equal(dense.cpu(), src[:37].cpu()) and torch.equal(table.view(-1).cpu(), want)
    with pytest.raises(ValueError, match="int32"):
        stage_words(src.long(), dense, table.view(-1))
    with pytest.raises(ValueError, match="odd"):
        stage_words(src[:-1], dense, table.view(-1))


def test_a_step_without_a_block_table():
    """A program that takes no block table (no MLA layer reads it) stages the other inputs."""
    gen = torch.Generator().manual_seed(3)
    full = _inputs()
    keep = [i for i, name in enumerate(full.names) if name != "meta.block_table"]
    inputs = StepInputs([full.per_step[i] for i in keep], [full.names[i] for i in keep],
                        [full.shapes[i] for i in keep], full.snapshots, full.batch_symbol, ROWS)
    pad = _padding(BUCKET)
    statics = StagedInputs(inputs, [pad[i].to(DEV) for i in keep], DEV)
    assert statics.capacity == 0
    step = _step(2, gen)
    del step[12]
    assert not _run(statics, step)
    for i, index in enumerate(inputs.per_step[:4]):
        want = torch.cat([step[index], pad[keep[i]][step[index].shape[0]:]])
        assert torch.equal(statics.buffers[i].cpu(), want), inputs.names[i]
