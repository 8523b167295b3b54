#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU (the H200 image: torch 2.11, Triton 3.6), from
# the repository root, with the machine's own python3 (nothing is installed). It runs
#   1. the compiled-program tests on the GPU (tests/runtime: tiny float32/bfloat16 and bench
#      configs against eager, every pass switched off, profile of a replayed step),
#   2. the kernels' real-shape tests (tests/lowering), unless --no-kernels,
#   3. with --bench, `k31c bench e2e` (benchmarks/e2e.py), the MoE op at K3.1 Pro shapes
#      (benchmarks/bench_moe.py), the chunked 32K / 128K prefill (benchmarks/prefill.py) and the
#      decode projections (benchmarks/bench_linear.py), into $OUT or . (bench-e2e.md,
#      bench-moe.md, prefill.md, bench-linear.md); about 4, 1, 1.5 and 1 minutes.
# --kernels-only runs part 2 alone. --shard I/N runs the I-th of N shards of parts 1 and 2 (the
# slowest tests spread first by their measured times, tests/pytest_shard.py, the rest round
# robin): the N commands with I = 1..N run them all once. --parallel N runs those N shards at once,
# each in its own process, its log in $LOGS/gpu-check[-programs|-kernels]-I.log ($LOGS, created
# where missing: $OUT, else .; the part in the name with --no-kernels or --kernels-only, so two
# calls keep both), and prints each shard's pytest summary: the tests are mostly Inductor and
# Triton compiling on the CPU cores, so one H200 machine (16 cores) runs them side by side. N is
# capped at the GPU's memory over $SHARD_GIB (default 16 GiB a shard; it says so when it caps):
# 8 shards at once ran out of GPU memory on an 80 GB H100, so there N is at most 4. On a cold H200
# part 1 took more than 7 minutes and part 2 about 8 run one after the other; in three sequential
# shards 499 / 370 / 353 s. On a cold H100 at 4 shards part 1 alone took 295-365 s a shard and
# both parts ran past 590 s.
# Where one command may run at most 10 minutes, use `--parallel 3` (or the three --shard commands)
# on an H200; on an H100 `--parallel 4 --no-kernels`, then `--parallel 4 --kernels-only` (37-62 s
# a shard after the first call's compiles); then `--bench-only` for part 3 alone. Send the output
# to a file that comes back even when the command is cut off (e.g. `> $OUT/check.log 2>&1`): a
# pipe through grep or tail loses it.
# Other arguments go to part 1's pytest (e.g. -k bench).
# A test running longer than $STALL seconds (default 300) has its threads' stacks dumped to the log;
# each shard's log ends with its 8 slowest tests (what to shorten when the check grows, and the
# times tests/pytest_shard.py's SLOW_TESTS weighs the shards by).
# Exit status: non-zero if any part failed. Inductor's cache goes to .inductor-cache/ (kept on a
# warm machine between calls).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export K31C_FAILURES_AT_ONCE=1     # tests/conftest.py: a failure's traceback as it happens
export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor-cache"
PY=${PYTHON:-python3}
STALL=${STALL:-300}    # a stalled shard says where: the stacks of a test past STALL seconds
kernels=1 bench=0 program=1 rest=() shard=() parallel=0 args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --no-kernels) kernels=0 ;;
        --kernels-only) program=0 ;;
        --bench) bench=1 ;;
        --bench-only) bench=1 program=0 kernels=0 ;;
        --shard) [ $# -ge 2 ] || { echo "gpu_check: --shard needs I/N (e.g. 2/3)" >&2; exit 2; }
                 shard=(--shard "$2"); shift ;;
        --parallel) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || {
                        echo "gpu_check: --parallel needs a number of shards (e.g. 3)" >&2; exit 2; }
                    parallel=$2; shift ;;
        *) rest+=("$1") ;;
    esac
    shift
done
"$PY" -c "
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit(f'gpu_check: no CUDA device visible to torch {torch.__version__} ({sys.executable})')
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1
if [ "$parallel" -gt 0 ]; then
    [ ${#shard[@]} -eq 0 ] && [ "$bench" = 0 ] || {
        echo "gpu_check: --parallel runs the shards itself (no --shard, no --bench)" >&2; exit 2; }
    # Each shard's tests hold up to ~SHARD_GIB of GPU memory at once: more shards than the GPU
    # holds fail with CUDA out of memory (8 did on an 80 GB H100; an H200's 140 GiB holds 8).
    shard_gib=${SHARD_GIB:-16}
    gib=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)") || exit 1
    fit=$(( gib / shard_gib > 1 ? gib / shard_gib : 1 ))
    if [ "$parallel" -gt "$fit" ]; then
        echo "gpu_check: --parallel $parallel capped to $fit: the GPU's $gib GiB hold $fit shards of $shard_gib GiB (SHARD_GIB)"
        parallel=$fit
    fi
    logs=${LOGS:-${OUT:-.}}
    mkdir -p "$logs" || exit 1
    own=()        # this command's arguments without --parallel N, for each shard
    skip=0
    for a in "${args[@]}"; do
        if [ "$skip" = 1 ]; then skip=0; continue; fi
        if [ "$a" = --parallel ]; then skip=1; continue; fi
        own+=("$a")
    done
    # Each shard's Inductor compile pool gets its share of the cores: N pools of nproc workers each
    # oversubscribe the machine (a shard stalled in async_compile.wait under 6 x 16 workers).
    cores=$(nproc)
    export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( cores / parallel > 1 ? cores / parallel : 1 ))}
    echo "gpu_check: $parallel shards, $TORCHINDUCTOR_COMPILE_THREADS Inductor compile threads each"
    part=""
    [ "$kernels" = 0 ] && part="-programs"
    [ "$program" = 0 ] && part="-kernels"
    pids=()
    for i in $(seq 1 "$parallel"); do
        bash "$0" "${own[@]}" --shard "$i/$parallel" > "$logs/gpu-check$part-$i.log" 2>&1 &
        pids+=($!)
    done
    status=0
    for i in $(seq 1 "$parallel"); do
        wait "${pids[$((i - 1))]}" || status=1
        echo "shard $i/$parallel: $(grep -E '^[0-9]+ (passed|failed)|^(FAILED|ERROR) |(passed|failed|error).* in [0-9.]+s' \
            "$logs/gpu-check$part-$i.log" | tr '\n' ' ')"
    done
    exit $status
fi
status=0
if [ "$program" = 1 ]; then
    "$PY" -m pytest -q -p no:cacheprovider -p no:logging -o faulthandler_timeout=$STALL --durations=8 \
        -s tests/runtime \
        "${shard[@]}" "${rest[@]}" || status=1
fi
if [ "$kernels" = 1 ]; then
    "$PY" -m pytest -q -p no:cacheprovider -p no:logging -o faulthandler_timeout=$STALL --durations=8 \
        tests/lowering \
        --ignore=tests/lowering/test_aot.py "${shard[@]}" || status=1
fi
if [ "$bench" = 1 ]; then
    "$PY" -m k31c bench e2e --out "${OUT:-.}/bench-e2e.md" || status=1
    "$PY" benchmarks/bench_moe.py > "${OUT:-.}/bench-moe.md" || status=1
    "$PY" benchmarks/prefill.py --out "${OUT:-.}/prefill.md" || status=1
    "$PY" benchmarks/bench_linear.py > "${OUT:-.}/bench-linear.md" || status=1
fi
exit $status
