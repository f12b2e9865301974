#!/usr/bin/env bash
# The memory and scheduling figures on one GPU, in one call, in this order (docs/results.md,
# "Memory beside the KV pool" and "The server path"):
#   1. the RL workload offline (256 x 1k in / 1k out, CUDA defaults, bit-exact spot check);
#   2. `lockstep serve` with its startup reservation (`GET /v1/engine`: kv_budget, memory);
#   3. 64 concurrent streaming completions, 512 in / 256 out: TTFT, ITL (p50, p99, max);
#   4. 256 concurrent POST /generate, 1k / 1k, logprobs: the wall against (1);
#   5. the GPU memory test (peak allocation inside weights + pool + reservation).
# Run from the repository root on the GPU machine; results go to $OUT (default ./out).
# About 8 minutes on an H200.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
M="--model random:qwen3-8b --device cuda --dtype bfloat16"
W="--num-prompts 256 --input-len 1024 --output-len 1024"
timeout 200 python3 -m lockstep bench throughput $M $W --output "$OUT/tput.json" 2>&1 \
    | grep -v "output tokens" | head -12
date -u
python3 -m lockstep serve $M --port 8000 > "$OUT/serve.log" 2>&1 &
SERVER=$!
python3 - <<'PY'
import json, time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health")
        break
    except Exception:
        time.sleep(2)
d = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/engine"))
print("pool", d["stats"]["kv_total"], "reserved", json.dumps(d["kv_budget"]["reserved"]),
      "memory", json.dumps(d["memory"]))
PY
timeout 120 python3 -m lockstep bench serve --api completions --max-concurrency 64 \
    --num-prompts 256 --input-len 512 --output-len 256 --warmup 64 --no-progress \
    --output "$OUT/serve_stream.json" 2>&1 | head -14
timeout 150 python3 -m lockstep bench serve --api generate --no-stream --logprobs $W \
    --warmup 64 --no-progress --output "$OUT/serve_generate.json" 2>&1 | head -12
kill $SERVER
wait $SERVER
date -u
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_memory.py 2>&1 | tail -3
date -u
