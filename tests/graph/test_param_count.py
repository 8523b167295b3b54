"""Parameter counts (graph/sizes.py: one layer of each kind on the meta device) against the whole
built model's, and the full-size model counted without building it."""
import pytest
import torch

from k31c.config import preset
from k31c.graph.model import K31ForCausalLM
from k31c.graph.sizes import parameter_groups, part_of


def built_counts(cfg) -> dict[str, int]:
    """The whole model on the meta device, its parameters grouped as `k31c info` groups them."""
    with torch.device("meta"):
        model = K31ForCausalLM(cfg)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None
        part = part_of(name, layer is not None and cfg.is_mla_layer(layer))
        groups[part] = groups.get(part, 0) + p.numel()
    return groups


@pytest.mark.parametrize("changes", [
    {},
    dict(index_n_heads=None, index_head_dim=None, index_topk=None),                  # dense MLA
    dict(gate_lower_bound=None, use_full_rank_gate=False, attn_res_block_size=None,   # Kimi Linear style
         mla_use_output_gate=False, routed_expert_hidden_size=None, latent_moe_use_norm=False,
         hidden_act="silu"),
    dict(q_lora_rank=None, index_n_heads=None, index_head_dim=None, index_topk=None,
         num_shared_experts=0, latent_moe_use_norm=False, first_k_dense_replace=3),
    dict(num_experts=None),                                                          # no MoE at all
])
def test_counts_equal_the_built_models(changes):
    cfg = preset("tiny").replace(**changes) if changes else preset("tiny")
    assert parameter_groups(cfg) == built_counts(cfg)


def test_full_size_counted_from_the_config():
    cfg = preset("k3.1-pro")
    counts = parameter_groups(cfg)
    n = sum(counts.values())
    assert len(cfg.mla_layers) == 24 and len(cfg.kda_layers) == 69
    # routed experts: 92 MoE layers x 896 experts x 3 x 3072 x 3584
    assert counts["routed experts"] == 92 * 896 * 3 * 3072 * 3584
    assert 2.7e12 < n < 2.9e12, n
    # indexer per MLA layer: wq_b 4096x1536 + wk 128x7168 + k_norm 2x128 + weights_proj 32x7168
    assert counts["indexer"] == 24 * (4096 * 1536 + 128 * 7168 + 256 + 32 * 7168)


@pytest.mark.parametrize("name", ["tiny", "k3.1-pro", "kimi-k3"])
def test_cache_bytes_are_what_the_pool_allocates(name):
    """`k31c info`'s cache bytes a token in each pool format equal the bytes of the MLA planes a
    CachePool of that format allocates (on the meta device), divided by its tokens; the KDA state
    a request likewise."""
    from k31c.graph.sizes import cache_bytes
    from k31c.runtime.kv import CachePool
    cfg = preset(name)
    c = cache_bytes(cfg)
    index_formats = ("bf16", "fp8", "mxfp8") if cfg.has_indexer else ("bf16",)
    assert sorted(c.index_per_token) == (sorted(index_formats) if cfg.has_indexer else [])
    for latent in ("model", "fp8"):
        for index in index_formats:
            pool = CachePool(cfg, max_requests=2, max_seq_len=64, block_size=16, index_cache=index,
                             latent_cache=latent, device="meta")
            tokens = pool.num_blocks * 16
            nbytes = [sum(getattr(m, plane).numel() * getattr(m, plane).element_size() for m in pool.mla)
                      for plane in ("latent", "index")]
            assert nbytes[0] == c.latent_per_token[latent] * tokens, (latent, index)
            assert nbytes[1] == c.index_per_token.get(index, 0) * tokens, (latent, index)
            state = sum(t.numel() * t.element_size() for s in pool.kda for t in (s.conv, s.recurrent))
            assert state == c.kda_state_per_request * 2
