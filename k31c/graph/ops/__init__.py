"""The k31c op set (namespace `k31c`): where state lives, where a kernel is hand-written, or where
a pass needs a handle. Each module defines its ops with `torch.library.custom_op` (schema),
`register_fake` (shapes for tracing) and the reference implementation in plain PyTorch, which is
the oracle every kernel is tested against. No kernels live here.

Conventions shared by all ops (see graph/step.py for the row layout):
- rows: N query rows; `row_req[N]` int32 names each row's request, `row_len[N]` int32 the number
  of keys it sees (its own position + 1; causal and verification limits both come from this);
- logical position p of request b lives in physical slot
  `block_table[b, p // block_size] * block_size + p % block_size`;
- `slot_mapping[N]` int64 is the physical slot each new row is written to;
- top-k index lists are int32 logical positions within the request, `-1` = empty slot.

| op | module |
|---|---|
| mla_cache_write, index_cache_write, index_key_norm_write | cache_write.py |
| lightning_indexer, topk_select, lightning_indexer_topk    | indexer.py |
| sparse_mla, dense_mla                                     | mla.py |
| kda_prefill, kda_decode                                   | kda.py |
| moe_route, moe_experts                                    | moe.py |
| linear_group                                              | linear.py |
| attn_res_norm                                             | attn_res.py |
| region_enter, region_exit, event_record, event_wait       | streams.py |
"""
import importlib

import torch

for _m in ("cache_write", "indexer", "mla", "kda", "moe", "linear", "attn_res", "streams"):
    importlib.import_module(f"{__name__}.{_m}")


def is_k31c_op(target) -> bool:
    """Whether a call target is an op of this set (stream markers included)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "k31c"


def is_k31c(node: torch.fx.Node) -> bool:
    """Whether an FX node calls an op of this set (stream markers included)."""
    return node.op == "call_function" and is_k31c_op(node.target)
