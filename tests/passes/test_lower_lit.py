"""lower, lit-style: each k31c op gets its kernel for the target; markers noop or stream."""
import re

import pytest

from lit_helpers import FileCheck, lines_with

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write", "fuse_lightning_indexer",
         "quantize", "superkernels"]


def test_cpu_runs_the_reference_ops(lit):
    r = lit.run("lower", prior=PRIOR)
    (FileCheck().check("k31c.kda_decode(").check_same("kernel=reference")
     .check("k31c.region_enter(").check_same("kernel=noop")
     .check("k31c.sparse_mla(").check_same("kernel=reference").run(r.after))
    assert not any(re.search(r"[{ ]kernel=", line) for line in r.after.splitlines() if " = aten." in line)
    assert r.record.result.stats["fallbacks"] == {}                  # the CPU's kernels are the reference ops


@pytest.mark.parametrize("target", ["h200", "mi350x"])
def test_gpu_targets_pick_triton_kernels(lit, target):
    r = lit.run("lower", prior=PRIOR, target=target)
    (FileCheck()
     .check("k31c.kda_decode(").check_same("kernel=triton:k31c.lowering.triton.kda_decode.kda_decode")
     .check("k31c.region_enter(").check_same("kernel=stream")
     .check("k31c.index_key_norm_write(").check_same("kernel=triton:k31c.lowering.triton.cache_write.")
     .check("k31c.lightning_indexer_topk(").check_same("kernel=triton:k31c.lowering.triton.indexer_topk.")
     .check("k31c.sparse_mla(").check_same("kernel=triton:k31c.lowering.triton.mla")
     .run(r.after))
    stats = r.record.result.stats
    k31c_ops = [line for line in lines_with(r.after, " = k31c.") if "kernel=stream" not in line]
    assert sum(stats["kernels"].values()) == len(k31c_ops)
    assert sum(stats["fallbacks"].values()) == r.after.count("kernel=reference")
