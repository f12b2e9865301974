#!/usr/bin/env bash
# The end-to-end GPU run (one device call): property suite on real shapes, decode benchmark
# (deterministic vs fast, CUDA graphs), a 128k-token prompt. Writes logs and JSON under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -q -x tests/test_gpu_engine.py -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 150 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda --dtype bfloat16 \
  --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 --max-model-len 4096 \
  --output "$OUT/bench_decode_qwen3_8b_h200.json" 2>&1 | tail -12
timeout 100 python3 scripts/long_prompt.py --model random:qwen3-8b --tokens 131072 2>&1 | tee "$OUT/long_prompt_qwen3_8b_h200.json" | tail -3
