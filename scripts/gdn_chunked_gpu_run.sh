#!/usr/bin/env bash
# The chunked gated delta rule (--gdn-kernel chunked) against the recurrent one on one GPU,
# random:qwen3.5-9b, for docs/results.md. Stages (each within one 10-minute device call):
#   kernels  the kernels alone (scripts/gdn_chunked_bench.py: us per call at prefill and
#            decode shapes, split invariance at the model's head sizes) and their tests on
#            the GPU (tests/kernels/test_chunked_delta_triton.py);
#   engine   256 x 1k/1k offline with each kernel (prefill tok/s, wall, bit-exact spot check)
#            and batch-1 / batch-64 decode ms/step with each;
#   tests    the GPU property suite with the option on (tests/gpu/test_gpu_gdn_chunked.py).
# Run from the repository root on the GPU machine: scripts/gdn_chunked_gpu_run.sh STAGE...
# Results go to $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
M="--model random:qwen3.5-9b --device cuda --dtype bfloat16"
W="--num-prompts 256 --input-len 1024 --output-len 1024"
for stage in "${@:-kernels}"; do
    date -u
    case "$stage" in
    kernels)
        timeout 240 python3 scripts/gdn_chunked_bench.py | tee "$OUT/gdn_kernels.txt"
        timeout 300 python3 -m pytest -q -p no:cacheprovider \
            tests/kernels/test_chunked_delta_triton.py 2>&1 | tail -5
        ;;
    engine)
        for kernel in recurrent chunked; do
            timeout 200 python3 -m lockstep bench throughput $M $W --gdn-kernel "$kernel" \
                --output "$OUT/tput_$kernel.json" 2>&1 | grep -v "output tokens" | head -14
        done
        for kernel in recurrent chunked; do
            timeout 120 python3 -m lockstep bench decode $M --modes deterministic \
                --batches 1,64 --gdn-kernel "$kernel" --output "$OUT/decode_$kernel.json" \
                2>&1 | tail -6
        done
        ;;
    tests)
        timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_gdn_chunked.py \
            2>&1 | tail -8
        ;;
    *)
        echo "unknown stage $stage: expected kernels, engine or tests" >&2
        exit 2
        ;;
    esac
done
date -u
