#!/usr/bin/env bash
# Seventh session, device calls 2-4: the merge's loads kept in flight (docs/gpu_notes.md,
# "Seventh session"). Bits first, then timings:
#   1. the attention kernel tests on the GPU (the chunk test at D = 128: 32/64/128 columns)
#   2. batch 1/32/128: each kernel's share, merge shapes (stages, warps, columns), splits of
#      256 keys (other numerics)
#   3. the decode graphs (batch 1 and 32): the table (o at 7 stages) vs o at 5 stages
#   4. the decode attention table (the cells) and the decode bench
# Usage (device): bash scripts/gpu_merge_experiments.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
echo "== attention kernel tests"
timeout 150 python3 -m pytest -q tests/test_ops_triton.py -k attention -p no:cacheprovider 2>&1 \
  | tee "$OUT/attention_tests.log" | tail -3 || status=1
echo "== split kernel vs merge: merge shapes, splits of 256 keys"
timeout 150 python3 scripts/attn_decode_probe.py --batches 1,32 --contexts 512,1024,8192,32768 \
  --kernels --variants st4=merge_stages:4 st12=merge_stages:12 w4=merge_warps:4 \
  c128=merge_cols:128 s256=split:256 2>&1 | grep "^B" || status=1
timeout 60 python3 scripts/attn_decode_probe.py --batches 128 --contexts 1024,8192 \
  --kernels --variants c128=merge_cols:128 2>&1 | grep "^B" || status=1
echo "== decode graphs: the table vs o at 5 stages"
timeout 120 python3 scripts/graph_timeline.py --batch 1 --out "$OUT/graph_timeline_b1_merge.json" \
  --variants base: o5:o=16-32-256-4-5 base2: 2>&1 \
  | grep "^==\|^attn\|^merge\|matmul o " || status=1
timeout 120 python3 scripts/graph_timeline.py --batch 32 --out "$OUT/graph_timeline_b32_merge.json" \
  --variants base: 2>&1 | grep "^==\|^attn\|^merge" || status=1
echo "== decode attention table"
timeout 120 python3 -m lockstep.bench.gpu_kernels --only decode \
  --out "$OUT/gpu_attention_decode_merge_h200.json" 2>&1 | grep "^decode" || status=1
echo "== decode bench"
timeout 200 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda \
  --dtype bfloat16 --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 \
  --max-model-len 4096 --modes deterministic --output "$OUT/bench_decode_qwen3_8b_h200_merge.json" \
  2>&1 | tail -4 || status=1
exit $status
