"""The canonical text and the SVG picture of a graph."""
import re
import xml.dom.minidom

import pytest

from pass_helpers import MLALayer, capture_layer, passes, tiny_cfg
from k31c.graph.printer import format_graph
from k31c.graph.svg import draw_svg


@pytest.fixture(scope="module")
def layer_graphs():
    cfg = tiny_cfg()
    layer = MLALayer(cfg).eval()
    first, _ = capture_layer(layer, cfg)
    second, _ = capture_layer(MLALayer(cfg).eval(), cfg)       # another trace, other objects
    return passes(first)[0], passes(second)[0]


def test_text_is_deterministic_and_addressless(layer_graphs):
    a, b = layer_graphs
    text = format_graph(a, title="t")
    assert text == format_graph(b, title="t")
    assert not re.search(r"0x[0-9a-f]{6,}", text)
    assert "object at" not in text


def test_every_op_shows_its_stream_and_sorted_metadata(layer_graphs):
    text = format_graph(layer_graphs[0])
    body = text.split("nodes:\n")[1].splitlines()[:-1]
    assert body and all(re.search(r"  stream=\d+", line) for line in body)
    for line in body:
        meta = re.search(r"\{(.*)\}$", line)
        if meta:
            keys = [kv.split("=")[0] for kv in meta.group(1).split(", ")]
            assert keys == sorted(keys)
    wk = next(line for line in body if "indexer.wk/linear" in line)
    assert "stream=1" in wk and "branch=key" in wk
    assert "@self_attn.indexer.wk.weight" in wk                     # weights by module path


def test_names_come_from_module_path_and_op(layer_graphs):
    text = format_graph(layer_graphs[0])
    assert "%self_attn.indexer/lightning_indexer_topk = k31c.lightning_indexer_topk(" in text
    assert "%self_attn.q_a_layernorm/mul#1 = aten.mul.Tensor(" in text
    assert "%meta.slot_mapping : i64[s0]" in text and "%meta.cu_seqlens : i32[s0 + 1]" in text


def test_svg_draws_lanes_regions_and_superkernels(layer_graphs):
    svg = draw_svg(layer_graphs[0], title="layer")
    doc = xml.dom.minidom.parseString(svg)
    texts = [t.firstChild.data for t in doc.getElementsByTagName("text") if t.firstChild]
    assert {"stream 0", "stream 1", "stream 2"} <= set(texts)
    assert any(t.startswith("region 0: indexer_prolog") for t in texts)
    assert any(t.startswith("sk ") for t in texts)
    assert 'stroke-dasharray="4,3"' in svg                           # superkernel outlines
    assert 'stroke="#8e44ad"' in svg                                 # fork/join event arrows
    boxes = [g for g in doc.getElementsByTagName("g")]
    assert len(boxes) == sum(1 for n in layer_graphs[0].graph.nodes if n.op == "call_function")
    with pytest.raises(ValueError, match="layer 9"):
        draw_svg(layer_graphs[0], layer=9)
