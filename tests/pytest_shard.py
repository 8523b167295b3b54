"""The --shard I/N option (tests/conftest.py): its argument, and which shard runs which test."""
import pytest

# Seconds (call and setup) of the slowest tests in a GPU check (`scripts/gpu_check.sh --parallel 6`
# on an H100, 2026-12-06; each shard's log ends with its slowest 8): scheduling weights, so that
# the compile-heavy program tests spread over the shards. A test not listed weighs DEFAULT_SECONDS.
SLOW_TESTS = {
    "tests/runtime/test_gpu_program.py::test_bench_config": 150,
    "tests/runtime/test_gpu_program.py::test_the_fused_select_in_a_program": 90,   # estimated: two fx compiles
    "tests/runtime/test_gpu_compile_cache.py::test_a_copied_prebuilt_cache_starts_without_compiling_a_triton_kernel": 141,
    "tests/runtime/test_gpu_program.py::test_tiny_float32_inductor": 97,
    "tests/runtime/test_gpu_compile_cache.py::test_warm_program_loads_and_replays": 97,
    "tests/runtime/test_gpu_compile_cache.py::test_prebuild_compiles_ahead_on_threads": 90,
    "tests/runtime/test_gpu_program.py::test_programmatic_dependent_launch": 88,
    "tests/runtime/test_gpu_compile_cache.py::test_generate_on_h200_builds_then_loads": 86,
    "tests/runtime/test_gpu_program.py::test_tiny_bfloat16": 76,
    "tests/runtime/test_sparse_prefill.py::test_bench_sparse_prefill_on_the_gpu[2048]": 69,
    "tests/runtime/test_sparse_prefill.py::test_bench_sparse_prefill_on_the_gpu[8192]": 63,
    "tests/runtime/test_gpu_program.py::test_tiny_on_fp8_latent_and_mxfp8_index_caches": 48,
    "tests/runtime/test_sparse_prefill.py::test_chunked_prefill_equals_one_prefill": 46,
    "tests/runtime/test_sparse_prefill.py::test_sparse_prefill_equals_the_mha_reference": 30,
    "tests/runtime/test_sparse_prefill.py::test_without_an_indexer_prefill_is_dense_absorbed": 23,
    "tests/lowering/test_triton_indexer.py::test_real_shape[False-fp8-gather]": 23,
    "tests/lowering/test_triton_indexer.py::test_real_shape[True-fp8-gather]": 22,
    "tests/runtime/test_gpu_program.py::test_profile_of_a_replayed_step_shows_the_kernels": 22,
    "tests/runtime/test_gpu_program.py::test_device_step_inputs_do_not_wait_for_the_device": 19,
    "tests/lowering/test_fused_indexer_topk.py::test_fused_select_real_shapes[1048576-False]": 18,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[indexer_prolog]": 17,
    "tests/lowering/test_fused_indexer_topk.py::test_fused_select_real_shapes[131072-False]": 17,
    "tests/lowering/test_triton_mla.py::test_split_dense_rows_of_several_requests_in_one_tile": 16,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[fuse_index_write]": 14,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[canonicalize]": 13,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[quantize]": 13,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[annotate_layers]": 13,
    "tests/lowering/test_triton_mla_fp8.py::test_two_pass_fp8_gpu_tile_plan_on_k31_widths[256]": 13,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[fuse_lightning_indexer]": 12,
    "tests/lowering/test_triton_moe.py::test_experts_router_output_and_large_tiles": 11,
    "tests/lowering/test_triton_mla.py::test_two_pass_gpu_tile_plan_on_k31_widths": 11,
    "tests/runtime/test_gpu_program.py::test_each_pass_switched_off[lower]": 10,
    "tests/lowering/test_triton_topk.py::test_select_kth_with_and_without_the_common_prefix[bracketed]": 10,
    "tests/lowering/test_triton_indexer.py::test_real_shape[False-fp8-tma]": 10,
    "tests/lowering/test_triton_indexer_mxfp8.py::test_mxfp8_k31_shapes[4]": 10,
    "tests/lowering/test_fused_indexer_topk.py::test_fused_select_matches_reference[fp8]": 10,
}
DEFAULT_SECONDS = 2.0


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 1 <= I <= N; a clear error otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard: expected I/N such as 2/3, got {text!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard: expected 1 <= I <= N, got {text!r}")
    return i, n


def shards_of(nodeids: list[str], n: int) -> list[int]:
    """The shard (0 .. n-1) of each test: longest first, each to the shard with the least time so
    far (weights from SLOW_TESTS), ties to the lowest shard. Tests of equal weight keep their
    collected order, so where none is listed this is round robin; the same selection always gives
    the same shards, so the N commands run each test once."""
    weight = [SLOW_TESTS.get(nodeid, DEFAULT_SECONDS) for nodeid in nodeids]
    loads = [0.0] * n
    shard = [0] * len(nodeids)
    for j in sorted(range(len(nodeids)), key=lambda j: -weight[j]):      # stable: collected order
        shard[j] = min(range(n), key=lambda i: (loads[i], i))
        loads[shard[j]] += weight[j]
    return shard
