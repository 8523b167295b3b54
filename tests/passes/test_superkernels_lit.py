"""superkernels, lit-style: runs of dense ops on one stream get an id; k31c ops never do."""
import re

from lit_helpers import FileCheck

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write", "fuse_lightning_indexer",
         "quantize"]


def test_runs_end_at_k31c_ops_markers_and_streams(lit):
    r = lit.run("superkernels", prior=PRIOR)
    FileCheck().check_not("superkernel=").run(r.before)
    body = [line for line in r.after.split("nodes:\n")[1].splitlines() if " = " in line]
    ids = [(re.search(r"superkernel=(\d+)", line), line) for line in body]
    for m, line in ids:
        if " = k31c." in line:
            assert m is None, line                      # a k31c op is its own kernel
    runs = {}
    for m, line in ids:
        if m:
            runs.setdefault(int(m.group(1)), set()).add(re.search(r"stream=(\d)", line).group(1))
    assert all(len(streams) == 1 for streams in runs.values())      # never across streams
    # stream 1 holds one dense op (wk) before the fused write: a single op stays unmarked;
    # stream 2's projection and scale are one run
    assert {s for streams in runs.values() for s in streams} == {"0", "2"}
    (FileCheck()
     .check("%layers.1.self_attn.indexer.wk/linear").check_same("stream=1").check_not("superkernel=")
     .check("k31c.index_key_norm_write(")
     .check("%layers.1.self_attn.indexer.weights_proj/linear").check_same("stream=2").check_same("superkernel=")
     .check_next("%layers.1.self_attn.indexer/mul").check_same("stream=2").check_same("superkernel=")
     .run(r.after))
    stats = r.record.result.stats
    assert stats["superkernels"] == len(runs) and stats["ops"] == sum(1 for m, _ in ids if m)
