#!/usr/bin/env bash
# The next device session's experiment call (~7 min; docs/gpu_notes.md, "For the next device
# session", has the predictions), prepared after the sixth session's device time was spent.
# Bits first, then timings:
#   1. kernel tests, the attention tests once more under compute-sanitizer (the interpreter
#      cannot see an out-of-bounds read; slot ids ahead loads past a block by design, masked)
#   2. the attention bits table with decode rows that force slot ids ahead on and off
#   3. the batch-32 decode graph with the residency limit raised (the graph's grid is sized
#      by its context bucket, so the table's limit of 3 per SM declines there)
#   4. batch 1: o and qkv at M = 1 with more stages (o's 64 KB in flight per SM is at the
#      edge of what the copy rate needs; 8 stages measured 6% faster once)
#   5. batch 1: how the time splits between the split kernel and the merge (32k: 0.53 of the
#      floor; if the merge's 64-step fold is most of it, precomputing its weights is next)
#   6. splits of 256 keys (other numerics) now that the prefill schedule is faster: decode
#      probe and prefill sweep
# Usage (device): bash scripts/gpu_experiments.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests"
timeout 170 python3 -m pytest -q tests/test_ops_triton.py tests/test_cuda_graph_inputs.py \
  tests/test_kernel_launch.py -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log" \
  | tail -3 || status=1
if command -v compute-sanitizer >/dev/null; then
  echo "== attention tests under compute-sanitizer"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    tests/test_ops_triton.py -k "slot_ids or one_row_decode" -p no:cacheprovider 2>&1 \
    | tail -5 || status=1
else
  echo "== compute-sanitizer not installed here: skipped"
fi
echo "== attention bits"
timeout 120 python3 -m lockstep.bench.gpu_kernels --only bits \
  --out "$OUT/gpu_attention_bits_h200.json" 2>&1 | grep "^bits" || status=1
echo "== batch-32 decode graph, residency limit 3 / 4 / 8 programs per SM"
timeout 150 python3 scripts/graph_timeline.py --batch 32 --out "$OUT/graph_timeline_b32.json" \
  --variants base: w4:attn_ahead_per_sm=4 w8:attn_ahead_per_sm=8 2>&1 \
  | grep "^timing\|^==\|^attn\|^merge" || status=1
timeout 90 python3 scripts/attn_decode_probe.py --batches 32 --contexts 512,1024,8192 \
  --variants w8=slots_ahead_programs_per_sm:8 2>&1 | grep "^B" || status=1
echo "== batch 1: o and qkv at M = 1 with more weight in flight (same tiles, more stages)"
timeout 120 python3 scripts/graph_timeline.py --batch 1 --out "$OUT/graph_timeline_b1_stages.json" \
  --variants base: o7:o=16-32-256-4-7 o8:o=16-32-256-4-8,qkv=16-64-256-4-5 \
  o9:o=16-32-256-4-9,qkv=16-64-256-4-6 base2: 2>&1 | grep "^==\|matmul o \|matmul qkv " || status=1
echo "== batch 1: the split kernel's and the merge's shares (the merge folds 64 partials at 32k)"
timeout 60 python3 scripts/attn_decode_probe.py --batches 1 --contexts 512,8192,32768 \
  --kernels 2>&1 | grep "^B" || status=1
echo "== splits of 256 keys (other numerics): decode probe, prefill sweep"
timeout 120 python3 scripts/attn_decode_probe.py --variants s256=split:256 \
  --batches 1,32 --contexts 512,1024,8192,32768 2>&1 | grep "^B" || status=1
timeout 200 python3 -m lockstep.bench.gpu_kernels --sweep --only prefill \
  --out "$OUT/gpu_attention_prefill_h200.json" 2>&1 | grep "^prefill" || status=1
exit $status
