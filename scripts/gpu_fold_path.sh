#!/usr/bin/env bash
# Eighth session, last device call: decode-shaped calls fold their splits in-kernel when the
# programs fill the GPU (`decode_path`, `fold_programs_per_sm`; docs/gpu_notes.md, "Eighth
# session", runs 70-72). Speed only, so bits first, then timings (~8 min):
#   1. the attention kernel tests (every path forced, the rule, the wrapper's choice)
#   2. the bits table with fold rows (table config, slot ids ahead forced, tl.sum's tiles)
#   3. the engine property suite (8 cases; one-split decodes now take the fold path)
#   4. the decode table (each cell on the wrapper's own path), the batch-32 and batch-1
#      decode graphs (fold vs the split path), the decode bench
# Usage (device): bash scripts/gpu_fold_path.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== attention kernel tests"
timeout 150 python3 -m pytest -q tests/test_ops_triton.py \
  -k "attention or decode_path or unforced" -p no:cacheprovider 2>&1 \
  | tee "$OUT/attention_tests.log" | tail -2 || status=1
echo "== bits table"
timeout 80 python3 -m lockstep.bench.gpu_kernels --sweep --only bits \
  --out "$OUT/gpu_attention_bits_fold_h200.json" 2>&1 | grep "^bits" || status=1
echo "== engine property suite, 8 cases"
LOCKSTEP_GPU_CASES=8 timeout 170 python3 -m pytest -q tests/test_gpu_engine.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -2 || status=1
echo "== decode table"
timeout 60 python3 -m lockstep.bench.gpu_kernels --only decode \
  --out "$OUT/gpu_attention_decode_fold_h200.json" 2>&1 | grep "^decode" || status=1
echo "== decode graphs: fold (table) vs the split path"
timeout 50 python3 scripts/graph_timeline.py --batch 32 --out "$OUT/graph_timeline_b32_fold.json" \
  --variants base: split:attn_fold=1000000 2>&1 | grep "^==\|^attn\|^merge" || status=1
timeout 30 python3 scripts/graph_timeline.py --batch 1 --out "$OUT/graph_timeline_b1_fold.json" \
  --variants base: 2>&1 | grep "^==\|^attn\|^merge" || status=1
echo "== decode bench"
timeout 90 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda \
  --dtype bfloat16 --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 \
  --max-model-len 4096 --modes deterministic --output "$OUT/bench_decode_qwen3_8b_h200_fold.json" \
  2>&1 | grep "^deterministic" || status=1
exit $status
