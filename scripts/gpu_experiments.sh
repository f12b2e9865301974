#!/usr/bin/env bash
# This session's prepared experiments, in one device call (~6 min); docs/gpu_notes.md has the
# predictions. Bits first (kernel tests, the attention bits table), then timings:
#   1. the merge kernel with eight partials in flight (was four): decode probe, prod column
#   2. splits of 256 and 128 keys (other numerics): decode probe, prefill sweep, and their
#      own decode = prefill bits
#   3. the sampler's kernels (noise, top-p units) and top-k without a sort: sampler_cost.py
# Usage (device): bash scripts/gpu_experiments.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== kernel tests"
timeout 200 python3 -m pytest -q tests/test_ops_triton.py tests/test_cuda_graph_inputs.py \
  tests/test_kernel_launch.py tests/test_sampler.py -k "not cpu_" -p no:cacheprovider 2>&1 \
  | tee "$OUT/kernel_tests.log" | tail -3 || status=1
echo "== decode probe (us per call, CUDA-graph replay)"
timeout 150 python3 scripts/attn_decode_probe.py --variants s256=split:256 s128=split:128 \
  --batches 1,32 --contexts 512,1024,2048,8192,32768 2>&1 | grep "^B\|tiny" || status=1
timeout 60 python3 scripts/attn_decode_probe.py --variants s256=split:256 s128=split:128 \
  --batches 128 --contexts 1024,8192 2>&1 | grep "^B" || status=1
echo "== attention bits and prefill sweep"
timeout 200 python3 -m lockstep.bench.gpu_kernels --sweep --only bits,prefill \
  --out "$OUT/gpu_attention_splits_h200.json" 2>&1 | grep "^bits\|^prefill" || status=1
echo "== sampler"
timeout 90 python3 scripts/sampler_cost.py --device cuda --batches 1,32,128 --reps 10 2>&1 \
  | tee "$OUT/sampler_cost_h200.txt" | grep "^batch" || status=1
echo "== batch-1 decode graph, qwen3-8b shapes"
timeout 60 python3 scripts/profile_decode.py --model random:qwen3-8b \
  --out "$OUT/profile_decode_qwen3_8b_h200.json" 2>&1 | grep "^floor\|_attn" || status=1
exit $status
