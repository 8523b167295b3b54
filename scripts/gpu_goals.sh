#!/usr/bin/env bash
# Issue 11's goal benchmarks on a GPU machine, in one command, each into $OUT (or .) as its own
# file, each under its own time limit so that one stall does not cost the others:
#   topk-quick.md   bench_topk.py --quick        G2: the select alone, per kernel, ring of 10
#   topk-pair.md    bench_topk.py --pair         G3: the op, the pair, the fused select, its parts
#   topk-short.md   bench_topk.py --pair --rows 32   32K rows in 128K / 1M tables (the op's choice)
#   layer.md        bench_layer.py --quick       G5, G5b: the sparse layer at 128K and 1M, with both selects
#   mla-heads.md    try_sparse_mla.py --head-probe   G4: the sparse kernel on 64 / 96 / 128 heads
#   kda-decode.md   bench_kda.py --decode        G8 (fla-core importable: carry build/vend)
# About 8 minutes on a warm H100. Run from the repository root with the machine's python3:
#   PYTHONPATH=.:build/vend bash scripts/gpu_goals.sh [NAME ...]     # NAMEs: a subset, e.g. layer
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-.}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
git log --oneline -1 2>/dev/null
declare -A limit=([topk-quick]=150 [topk-pair]=120 [topk-short]=90 [layer]=200 [mla-heads]=120 [kda-decode]=180)
declare -A cmd=([topk-quick]="benchmarks/bench_topk.py --quick" [topk-pair]="benchmarks/bench_topk.py --pair"
                [topk-short]="benchmarks/bench_topk.py --pair --rows 32" [layer]="benchmarks/bench_layer.py --quick"
                [mla-heads]="benchmarks/try_sparse_mla.py --head-probe" [kda-decode]="benchmarks/bench_kda.py --decode")
order=(topk-quick topk-pair topk-short layer mla-heads kda-decode)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${order[@]}")
status=0
for name in "${names[@]}"; do
    if [ -z "${cmd[$name]:-}" ]; then
        echo "gpu_goals: no benchmark '$name'; names: ${order[*]}" >&2
        exit 2
    fi
    t0=$SECONDS
    # shellcheck disable=SC2086  # the command's words
    timeout "${limit[$name]}" "$PY" ${cmd[$name]} > "$out/$name.md" 2>&1
    rc=$?
    [ "$rc" = 0 ] || status=1
    echo "$name rc=$rc $((SECONDS - t0)) s"
    grep -E "^# (G[0-9]|layer L=)|best .* TFLOP/s" "$out/$name.md" | head -12
done
exit $status
