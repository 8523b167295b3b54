#!/usr/bin/env bash
# session 51, call 2 (H200, warm): the kernels' GPU check of request-run (indexer helpers), then the skip append A/B again
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 bash scripts/gpu_check.sh --kernels-only --parallel 8 > $OUT/check-kernels.log 2>&1; echo "rc=$? t=$SECONDS" >> $OUT/check-kernels.log
CTXS=128,256,1024 timeout 200 python3 build/c49/filter_ab.py build/c50/filter_skip.py > $OUT/filter-ab2.md 2>&1; echo "rc=$? t=$SECONDS" >> $OUT/filter-ab2.md
true
