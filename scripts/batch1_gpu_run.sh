#!/usr/bin/env bash
# Batch-1 decode and speculation on one GPU, in one call (docs/results.md, "Batch-1 decode of
# every family on an H100" and "RL control surface and speculation on the GPU"). Stages, in
# the order given (default: verify-graphs mla fp8 floors):
#   verify-graphs  whole-step verify graphs (--verify-cuda-graphs): their GPU tests (outputs =
#                  plain decode, always-right and always-wrong drafters), then a verify step's
#                  cost against a decode step with and without them (random:smollm2-135m)
#   mla            MLA's fused input kernels (--mla-fused-input) against the composed ops, bit
#                  for bit compiled, then DeepSeek-V2-Lite's batch-1 step with and without them
#   fp8            the FP8 MoE kernel test and the DeepSeek FP8 GPU suite
#   floors         scripts/profile_decode.py at batch 1 for each family beside random:qwen3-8b
#   ngram GGUF     the embedded model's n-gram speculation on the copy prompts, plain and with
#                  verify graphs (GGUF: the path of SmolLM2-135M-Instruct.Q4_1.gguf there)
# Run from the repository root: scripts/batch1_gpu_run.sh [STAGE [ARG]...]. Results go to
# $OUT (default ./out). About 3 minutes a stage on an H100, 5 for floors.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cost() {  # cost NAME [verify_step_cost options]
    python3 scripts/verify_step_cost.py --model random:smollm2-135m --device cuda --k 4 \
        --context 512 --steps 24 --rounds 3 "${@:2}" > "$OUT/verify_cost_$1.txt" 2>&1
    tail -3 "$OUT/verify_cost_$1.txt" | head -2
}
profile() {  # profile NAME MODEL [profile_decode options]
    python3 scripts/profile_decode.py --model "random:$2" --batch 1 --prompt-len 512 \
        --steps 48 --out "$OUT/profile_b1_$1.json" "${@:3}" > "$OUT/profile_b1_$1.txt" 2>&1
    grep -E "^floor|Error" "$OUT/profile_b1_$1.txt" | tail -2
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(verify-graphs mla fp8 floors)
i=0
while [ $i -lt ${#stages[@]} ]; do
    stage=${stages[$i]}
    echo "=== $stage $(date -u +%T)"
    case $stage in
    verify-graphs)
        python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_speculative.py \
            -k verify_graphs 2>&1 | tail -3
        cost graphs --verify-graphs
        cost piecewise ;;
    mla)
        python3 -m pytest -q -p no:cacheprovider tests/kernels/test_latent_input_triton.py \
            2>&1 | tail -2
        profile deepseek-v2-lite deepseek-v2-lite
        profile deepseek-v2-lite-fused deepseek-v2-lite --mla-fused-input ;;
    fp8)
        python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_moe_triton.py \
            tests/gpu/test_gpu_deepseek_fp8.py 2>&1 | tail -4 ;;
    floors)
        for m in qwen3-8b deepseek-v2-lite qwen3-30b-a3b gemma3-4b qwen3.5-9b qwen3-8b-fp8 \
                 qwen3-30b-a3b-fp8; do
            echo "$m: $(profile "$m" "$m")"
        done ;;
    ngram)
        i=$((i + 1))
        gguf=${stages[$i]:?ngram needs the GGUF path}
        for graphs in "" --verify-cuda-graphs; do
            python3 -m lockstep bench speculative --model "$gguf" --device cuda \
                --prompts-file bench/copy_prompts.jsonl --max-tokens 96 --repeats 5 $graphs \
                --output "$OUT/bench_speculative_smollm2${graphs:+_graphs}.json" 2>&1 \
                | grep -E "median|identical" | tail -2
        done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
    i=$((i + 1))
done
