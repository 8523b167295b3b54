"""verify, lit-style: the pipeline's graph passes unchanged; a broken one fails with an error
that names its nodes as the dump does."""
import pytest
import torch

from k31c.errors import CompilerError, GraphVerificationError
from k31c.graph.printer import format_graph
from lit_helpers import FileCheck

PRIOR = ["canonicalize", "annotate_layers", "indexer_prolog", "fuse_index_write", "fuse_lightning_indexer",
         "quantize", "superkernels", "lower"]
K = torch.ops.k31c


def test_accepts_the_pipeline_and_changes_nothing(lit):
    r = lit.run("verify", prior=PRIOR)
    assert r.after == r.before and not r.record.result.changed
    assert r.record.result.stats["regions"] == 1 and r.record.result.stats["ops"] > 100


def test_a_missing_join_is_named_as_the_dump_names_it(lit):
    gm, _ = lit.graph(PRIOR)
    join = [n for n in gm.graph.nodes if n.target is K.event_wait.default and n.args == (1, 0)][0]
    gm.graph.erase_node(join)
    with pytest.raises(GraphVerificationError) as err:
        lit.run("verify", prior=PRIOR, gm=gm)
    assert isinstance(err.value, CompilerError)                      # a compiler bug, not a usage error
    message = str(err.value)
    (FileCheck().check("verify: region 0 exits before stream 1 is joined (last op "
                       "%layers.1.self_attn.indexer/event_record#1)").run(message))


def test_a_cross_stream_use_names_both_nodes(lit):
    gm, _ = lit.graph(PRIOR)
    wait = [n for n in gm.graph.nodes if n.target is K.event_wait.default and n.args == (0, 1)][0]
    gm.graph.erase_node(wait)                                         # the key stream never waits
    with pytest.raises(GraphVerificationError) as err:
        lit.run("verify", prior=PRIOR, gm=gm)
    intact, dims = lit.graph(PRIOR)
    text = format_graph(intact, dims=dims)                          # the dump names them so
    FileCheck().check("%layers.1.self_attn.indexer.wk/linear = aten.linear(%layers.1.input_layernorm/getitem#1,"
                      ).run(text)
    FileCheck().check("verify: %layers.1.self_attn.indexer.wk/linear (stream 1) uses "
                      "%layers.1.input_layernorm/getitem#1 from stream 0 without waiting").run(str(err.value))
