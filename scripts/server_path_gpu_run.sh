#!/usr/bin/env bash
# The server path on one GPU, in one call (docs/results.md, "The server path"): the offline
# loop (256 x 1k / 1k); streaming ITL at 64 concurrent with prompts never bounded beside
# streamed decodes (the default), then with --max-mixed-step-cost 2, each server's step counts;
# 256 concurrent POST /generate (1k / 1k, logprobs) against the offline wall; the eager and
# CUDA-graph decode step at batch 64 (the eager floor a mixed step pays); the RL control
# surface's GPU test. Results go to $OUT (default ./out). About 10 minutes on an H100: split
# it (the RL test alone) if the call's limit is near.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
M="--model random:qwen3-8b --device cuda --dtype bfloat16"
serve() {  # serve NAME [options]: start a server on :8000, wait until it answers
    python3 -m lockstep serve $M --port 8000 "${@:2}" > "$OUT/serve_$1.log" 2>&1 &
    SERVER=$!
    python3 -c 'import time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health"); break
    except Exception: time.sleep(2)'
}
stats() {
    python3 -c 'import json, urllib.request
d = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/engine"))["stats"]
print("stats", json.dumps({k: d[k] for k in ("num_steps", "steps_launched_ahead", "num_preemptions", "kv_total")}))'
}
stream() {
    timeout 150 python3 -m lockstep bench serve --api completions --max-concurrency 64 \
        --num-prompts 256 --input-len 512 --output-len 256 --warmup 64 --no-progress \
        --output "$OUT/stream_$1.json" 2>&1 | grep -E "wall time|TTFT|ITL|TPOT"
    stats
}
date -u
# The offline loop first, in the same call: the server's /generate wall is compared with it.
timeout 200 python3 -m lockstep bench throughput $M --num-prompts 256 --input-len 1024 \
    --output-len 1024 --output "$OUT/offline.json" 2>&1 | grep -E "wall time|KV pool|decode-only"
date -u
serve unbounded --max-mixed-step-cost 0
stream unbounded
timeout 150 python3 -m lockstep bench serve --api generate --no-stream --logprobs \
    --num-prompts 256 --input-len 1024 --output-len 1024 --warmup 64 --no-progress \
    --output "$OUT/generate.json" 2>&1 | grep -E "wall time|E2E"
stats
kill $SERVER; wait $SERVER
date -u
serve bounded --max-mixed-step-cost 2
stream bounded
kill $SERVER; wait $SERVER
date -u
for graphs in "" "--no-cuda-graphs"; do
    timeout 90 python3 -m lockstep bench decode $M --modes deterministic --batches 64 --prompt-len 512 --gen-len 32 \
        $graphs 2>&1 | grep -E "ms/step|deterministic" | head -4
done
date -u
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_rl.py -x -s 2>&1 | tail -15
date -u
