#!/usr/bin/env bash
# The server path on one GPU, random:qwen3-8b, in one call (docs/results.md, "The server
# path"). Stages, in the order given (default: generate default eager-0 decode rl):
#   tests       the piecewise CUDA graphs' GPU tests (bits equal to eager steps, the control)
#   generate    the offline loop (256 x 1k / 1k), then 256 concurrent POST /generate of the
#               same shape (logprobs) on a default server: the server's overhead, same call
#   default     streaming ITL at 64 concurrent (512 in / 256 out), the defaults
#   eager-C     the same, --max-mixed-step-cost C --no-piecewise-cuda-graphs (C = 0: no bound)
#   pw-C        the same, --max-mixed-step-cost C --piecewise-cuda-graphs
#   decode      a batch-64 decode step with CUDA graphs and without (what an eager step costs)
#   rl          the RL control surface's GPU test (tests/gpu/test_gpu_rl.py)
# Each server setting prints its step counts. Run from the repository root:
# scripts/server_path_gpu_run.sh [STAGE...]. Results go to $OUT (default ./out). About 2
# minutes a streaming setting on an H100, 3 for tests, 4 for generate, 4 for rl.
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
stats() {  # the server's step counts (warm-up included): launched ahead as offline?
    python3 -c 'import json, urllib.request
d = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/engine"))["stats"]
print("stats", json.dumps({k: d[k] for k in ("num_steps", "steps_launched_ahead", "num_preemptions")}))'
}
stream() {
    timeout 150 python3 -m lockstep bench serve --api completions --max-concurrency 64 \
        --num-prompts 256 --input-len 512 --output-len 256 --warmup 64 --no-progress \
        --output "$OUT/stream_$1.json" 2>&1 | grep -E "wall time|TTFT|ITL|TPOT"
    stats
}
[ $# -gt 0 ] || set -- generate default eager-0 decode rl
for what in "$@"; do
    date -u
    case "$what" in
    tests)
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_piecewise_graphs.py \
            2>&1 | tail -15
        continue ;;
    decode)
        for graphs in "" "--no-cuda-graphs"; do
            timeout 90 python3 -m lockstep bench decode $M --modes deterministic --batches 64 \
                --prompt-len 512 --gen-len 32 $graphs 2>&1 | grep -E "ms/step|deterministic" | head -4
        done
        continue ;;
    rl)
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_rl.py -x -s 2>&1 \
            | tail -15
        continue ;;
    generate)
        timeout 200 python3 -m lockstep bench throughput $M --num-prompts 256 --input-len 1024 \
            --output-len 1024 --output "$OUT/offline.json" 2>&1 | grep -E "wall time|decode-only|prefill"
        serve generate
        timeout 150 python3 -m lockstep bench serve --api generate --no-stream --logprobs \
            --num-prompts 256 --input-len 1024 --output-len 1024 --warmup 64 --no-progress \
            --output "$OUT/generate.json" 2>&1 | grep -E "wall time|E2E"
        stats
        kill $SERVER; wait $SERVER
        continue ;;
    default) opts=() ;;
    eager-*) opts=(--max-mixed-step-cost "${what#eager-}" --no-piecewise-cuda-graphs) ;;
    pw-*) opts=(--max-mixed-step-cost "${what#pw-}" --piecewise-cuda-graphs) ;;
    *) echo "unknown setting $what" >&2; exit 2 ;;
    esac
    echo "== $what: ${opts[*]}"
    serve "$what" "${opts[@]}"
    stream "$what"
    kill $SERVER; wait $SERVER
    grep -iE "error|traceback" "$OUT/serve_$what.log" | head -5
done
date -u
