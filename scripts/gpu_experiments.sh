#!/usr/bin/env bash
# The eighth session's first device call (run 64, 347 s; docs/gpu_notes.md, "Seventh
# session", "For the next device session", has the predictions, "Eighth session" the
# outcomes), prepared after the seventh session's device time was spent. Bits first, then
# timings:
#   0. the kernel tests added after the device time, on the GPU for the first time
#   1. the engine property suite on the merge as committed (stages capped at the wave's
#      partials; the seventh session's full run predates the cap)
#   2. o at M = 1, 8, 16 against cuBLAS (the table's 7 stages are new; the last sweep read
#      1.051x at M = 1 with 5)
#   3. the row sum as a dot (`row_sum="mma"`, other numerics) with 1 / 2 / 4 decode warps:
#      the probe, and the batch-1 / batch-32 decode graphs (the prefill sweep of run 56 read
#      0.808x / 0.905x / 0.893x of SDPA with it, faster than tl.sum's 0.815x / 0.933x / 0.913x)
# Usage (device): bash scripts/gpu_experiments.sh   (logs and JSON under $OUT)
# The timeouts add up to more than a device call's 600 s; the expected total is ~9.5 min
# (the seventh session: engine suite 227 s, attention tests 42-108 s). Run with a 600 s
# limit; anything cut off is the last graph timeline.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests added after the seventh session's device time (merge, workspaces)"
timeout 120 python3 -m pytest -q tests/test_ops_triton.py -k "merge or workspaces or split" \
  -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests_new.log" | tail -2 || status=1
echo "== engine property suite, 14 cases"
LOCKSTEP_GPU_CASES=14 timeout 270 python3 -m pytest -q tests/test_gpu_engine.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -2 || status=1
echo "== o at small M vs cuBLAS"
timeout 60 python3 -m lockstep.bench.gpu_kernels --only matmul --shapes o --ms 1,8,16 \
  --out "$OUT/gpu_matmul_o_small_m_h200.json" 2>&1 | grep -i "^mm\|^matmul" || status=1
echo "== decode attention with the row sum as a dot, 1 / 2 / 4 warps (other numerics)"
timeout 100 python3 scripts/attn_decode_probe.py --batches 1,32 --contexts 512,1024,8192,32768 \
  --kernels --variants m1=row_sum:mma m2=row_sum:mma,num_warps_split:2 \
  m4=row_sum:mma,num_warps_split:4 2>&1 | grep "^B" || status=1
timeout 50 python3 scripts/attn_decode_probe.py --batches 128 --contexts 1024,8192 \
  --variants m2=row_sum:mma,num_warps_split:2 2>&1 | grep "^B" || status=1
timeout 100 python3 scripts/graph_timeline.py --batch 1 --out "$OUT/graph_timeline_b1_mma.json" \
  --variants base: m1:attn_row_sum=mma m2:attn_row_sum=mma,attn_warps=2 \
  m4:attn_row_sum=mma,attn_warps=4 2>&1 | grep "^==\|^attn\|^merge" || status=1
timeout 80 python3 scripts/graph_timeline.py --batch 32 --out "$OUT/graph_timeline_b32_mma.json" \
  --variants base: m2:attn_row_sum=mma,attn_warps=2 2>&1 | grep "^==\|^attn\|^merge" || status=1
exit $status
