#!/usr/bin/env bash
# The fourth session's prepared experiments, in one device call (~4 min), each a speed switch
# that must not change a bit (docs/gpu_notes.md: predictions; docs/gpu.md: what each does):
#   1. scores_ahead_split / scores_ahead: the next key block's q @ K^T before this block's fold
#   2. LOCKSTEP_MM_PREFETCH=1: small-M matmuls prefetch their weight rows into L2 before the
#      PDL wait; LOCKSTEP_PDL_TRIGGER_FIRST=1: the next kernel may launch before this one's wait
# Usage (device): bash scripts/gpu_experiments.sh   (logs and JSON under $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== 1. scores ahead: bits (must be 0 differing), decode probe, prefill sweep"
timeout 120 python3 -m pytest -q tests/test_ops_triton.py -k "attention" -p no:cacheprovider 2>&1 | tail -2 || status=1
timeout 90 python3 scripts/attn_decode_probe.py --variants sa=scores_ahead_split:1 \
  --batches 1,32 --contexts 512,1024,8192,32768 2>&1 | grep "^B\|tiny" || status=1
timeout 120 python3 -m lockstep.bench.gpu_kernels --sweep --only bits,prefill \
  --out "$OUT/gpu_attention_scores_ahead_h200.json" 2>&1 | grep "ahead\|prefill L" || status=1
echo "== 2. weight prefetch x trigger-first: bits, then the batch-1 decode graph"
LOCKSTEP_MM_PREFETCH=1 LOCKSTEP_PDL_TRIGGER_FIRST=1 timeout 150 python3 -m pytest -q \
  tests/test_ops_triton.py tests/test_cuda_graph_inputs.py -k "matmul or graph or prefetch" \
  -p no:cacheprovider 2>&1 | tail -2 || status=1
for pf in 0 1; do for tf in 0 1; do
  echo "prefetch=$pf trigger_first=$tf"
  LOCKSTEP_MM_PREFETCH=$pf LOCKSTEP_PDL_TRIGGER_FIRST=$tf timeout 60 python3 scripts/profile_decode.py \
    --model random:qwen3-8b --out "$OUT/profile_decode_pf${pf}_tf${tf}.json" 2>&1 | grep "^floor" || status=1
done; done
exit $status
