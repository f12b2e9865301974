#!/usr/bin/env bash
# Eighth session: the table's row sum became a dot (`row_sum="mma"`) with decode tiles on 2
# warps (other numerics; docs/gpu_notes.md, "Eighth session"). Two device calls:
#   bash scripts/gpu_row_sum_adoption.sh bits     # kernel tests, bits table, engine suite,
#                                                 # prefill + decode tables (~8 min)
#   bash scripts/gpu_row_sum_adoption.sh timings  # decode bench, batch-1 graph, 128k prompt,
#                                                 # matmul table (~6 min)
# Logs and JSON under $OUT.
set -u -o pipefail
part=${1:-bits}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$part" = bits ]; then
  echo "== kernel tests"
  timeout 170 python3 -m pytest -q tests/test_ops_triton.py tests/test_cuda_graph_inputs.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log" | tail -2 || status=1
  echo "== bits table (every decode config against its row sum's prefill)"
  timeout 90 python3 -m lockstep.bench.gpu_kernels --sweep --only bits \
    --out "$OUT/gpu_attention_bits_mma_h200.json" 2>&1 | grep "^bits" || status=1
  echo "== engine property suite, 14 cases"
  LOCKSTEP_GPU_CASES=14 timeout 270 python3 -m pytest -q tests/test_gpu_engine.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -2 || status=1
  echo "== prefill and decode tables"
  timeout 150 python3 -m lockstep.bench.gpu_kernels --only prefill,decode \
    --out "$OUT/gpu_attention_mma_h200.json" 2>&1 | grep "^prefill\|^decode" || status=1
else
  echo "== decode bench"
  timeout 200 python3 -m lockstep bench decode --model random:qwen3-8b --device cuda \
    --dtype bfloat16 --batches 1,32 --prompt-len 512 --gen-len 64 --kv-tokens 65536 \
    --max-model-len 4096 --modes deterministic --output "$OUT/bench_decode_qwen3_8b_h200_mma.json" \
    2>&1 | tail -4 || status=1
  echo "== batch-1 decode graph"
  timeout 80 python3 scripts/graph_timeline.py --batch 1 --out "$OUT/graph_timeline_b1_mma.json" \
    --variants base: 2>&1 | tee "$OUT/graph_timeline_b1_mma.log" | grep "^==" || status=1
  echo "== 128k-token prompt"
  timeout 100 python3 scripts/long_prompt.py --model random:qwen3-8b --tokens 131072 2>&1 \
    | tee "$OUT/long_prompt_qwen3_8b_h200_mma.log" | tail -2 || status=1
  echo "== matmul table"
  timeout 150 python3 -m lockstep.bench.gpu_kernels --only matmul \
    --out "$OUT/gpu_matmul_table_h200.json" 2>&1 | grep "^mm" || status=1
fi
exit $status
