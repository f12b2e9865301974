#!/usr/bin/env bash
# This session's prepared experiment, in one device call (~5 min): the split path's fold in
# the split kernel (AttentionConfig.fused_merge_max_splits; docs/gpu_notes.md has the
# prediction). Bits first (kernel tests, the attention bits table), then timings: the decode
# probe with the merge kernel always (fm0), the default (fused up to 4 splits) and fused up to
# 64 splits (fm64), then the batch-1 decode graph of qwen3-8b shapes.
# Usage (device): bash scripts/gpu_experiments.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests (matmul arrival refactor, fused fold, PDL rule)"
timeout 200 python3 -m pytest -q tests/test_ops_triton.py tests/test_cuda_graph_inputs.py \
  tests/test_kernel_launch.py -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log" | tail -3 || status=1
echo "== decode probe (us per call, CUDA-graph replay)"
timeout 150 python3 scripts/attn_decode_probe.py --variants fm0=fused_merge_max_splits:0 \
  fm64=fused_merge_max_splits:64 --batches 1,32 --contexts 512,1024,2048,8192,32768 2>&1 \
  | grep "^B\|tiny" || status=1
timeout 60 python3 scripts/attn_decode_probe.py --variants fm0=fused_merge_max_splits:0 \
  fm64=fused_merge_max_splits:64 --batches 128 --contexts 1024,2048,8192 2>&1 | grep "^B" || status=1
echo "== bits table (decode configs vs prefill)"
timeout 120 python3 -m lockstep.bench.gpu_kernels --only bits --out "$OUT/gpu_attention_bits_h200.json" \
  2>&1 | grep "^bits" || status=1
echo "== batch-1 decode graph, qwen3-8b shapes"
timeout 60 python3 scripts/profile_decode.py --model random:qwen3-8b \
  --out "$OUT/profile_decode_qwen3_8b_h200.json" 2>&1 | grep "^floor\|_attn\|kernel " || status=1
exit $status
