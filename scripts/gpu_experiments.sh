#!/usr/bin/env bash
# The fifth session's experiment call (~6 min; docs/gpu_notes.md, run 42, has the predictions
# and outcomes), kept to re-run after kernel changes. Bits first (kernel tests, the attention
# bits table), then timings:
#   1. decode probe: the table's 512-key splits against splits of 256 and 128 keys (other
#      numerics), prefill sweep with the same, and each split size's decode = prefill bits
#   2. the sampler's kernels against the torch references: scripts/sampler_cost.py
#   3. the batch-1 decode graph of qwen3-8b shapes (attention and merge per call)
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
