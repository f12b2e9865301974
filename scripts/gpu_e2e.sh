#!/usr/bin/env bash
# The end-to-end GPU run (one device call): property suite on real shapes (random schedules,
# prefix hits, generation == scoring, a second process, CUDA graphs == eager, the fast-mode
# control), decode benchmark (deterministic vs fast, CUDA graphs), batch-1 decode profile, a
# 128k-token prompt. Writes logs and JSON under $OUT. The engine needs no server packages
# (and no gguf) for random-weight presets, so the GPU image's python runs it as is.
#   bash scripts/gpu_e2e.sh tests   # kernel tests + property suite (~7 min)
#   bash scripts/gpu_e2e.sh bench   # decode benchmark (overlapped = default, plain), profile, 128k prompt (~5 min)
# (two device calls: one call may run 10 minutes at most).
set -u -o pipefail
part=${1:-tests}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LOCKSTEP_GPU_CASES=${LOCKSTEP_GPU_CASES:-20}
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$part" = tests ]; then
timeout 150 python3 -m pytest -q tests/test_ops_triton.py tests/test_cuda_graph_inputs.py tests/test_kernel_launch.py -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log" | tail -4 || status=1
timeout 400 python3 -m pytest -q tests/test_gpu_engine.py -p no:cacheprovider --durations=6 2>&1 | tee "$OUT/gpu_tests.log" | tail -14 || status=1
else
timeout 120 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda --dtype bfloat16 \
  --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 --max-model-len 4096 \
  --output "$OUT/bench_decode_qwen3_8b_h200.json" 2>&1 | tail -7
timeout 120 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda --dtype bfloat16 \
  --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 --max-model-len 4096 \
  --modes deterministic --no-overlap-decode --output "$OUT/bench_decode_qwen3_8b_h200_no_overlap.json" 2>&1 | tail -4
timeout 60 python3 scripts/profile_decode.py --model random:qwen3-8b --out "$OUT/profile_decode_qwen3_8b_h200.json" 2>&1 | grep "floor\|phases\|after the"
timeout 90 python3 scripts/long_prompt.py --model random:qwen3-8b --tokens 131072 2>&1 | tee "$OUT/long_prompt_qwen3_8b_h200.json" | tail -2
fi
exit $status
