"""How Triton schedules the attention kernel's key-block loop, without a GPU: compile for sm_90
with the installed Triton and print shared memory, the async copies, the `async_wait` counts
(0 = the next block's copies are waited for at the top of each iteration: no overlap) and the
shared-memory buffers (`2x64x128` = double-buffered).

    python scripts/kernel_schedule.py [--path split|prefill] [--stages 2,3,4] [--ahead 0,1]

The device runs Triton 3.6; for its schedule use the same version here, e.g.
`python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0`,
then run this script with /tmp/t36/bin/python. This is how the sixth session found that the
decode loop was single-buffered until the slot ids were loaded a block ahead (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockstep.ops.triton import attention  # noqa: E402

POINTERS = {
    "q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "out": "*bf16", "cu_q": "*i32",
    "q_start": "*i32", "cu_kv": "*i32", "slot_table": "*i32", "ws_m": "*fp32", "ws_l": "*fp32",
    "ws_acc": "*fp32",
}  # fmt: skip
# The launcher specialises these as divisible by 16 on real shapes (Qwen3-8B: Hkv 8, D 128).
DIVISIBLE = {*POINTERS, "sqt", "sqh", "skc", "skh", "sot", "soh", "R"}


def compile_attention(path: str, stages: int, ahead: bool):
    """The production tile of `path` (split: 16 rows on one warp; prefill: 128 rows on 8)."""
    fn = attention._attn_fwd
    names = list(fn.arg_names)
    rows, warps = (16, 1) if path == "split" else (128, 8)
    constexprs = {
        "HKV": 8, "G": 4, "ROWS": rows, "BLOCK_N": 64, "SPLIT": 512, "D": 128,
        "WRITE_PARTIALS": int(path == "split"), "WIDE": False, "ROW_SUM_MMA": False,
        "SLOTS_AHEAD": ahead, "PDL": True,
    }  # fmt: skip
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif n in POINTERS:
            signature[n] = POINTERS[n]
        else:
            signature[n] = "fp32" if n == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in DIVISIBLE}
    src = ASTSource(
        fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )  # fmt: skip
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False},
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", choices=("split", "prefill"), default="split")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--ahead", default="0,1", help="slot ids a block ahead: 0, 1 or both")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, {args.path} path")
    for ahead in (bool(int(a)) for a in args.ahead.split(",")):
        for stages in map(int, args.stages.split(",")):
            kernel = compile_attention(args.path, stages, ahead)
            ttgir = kernel.asm["ttgir"]
            waits = re.findall(r"async_wait[^\n]*num = (\d+)", ttgir)
            buffers = re.findall(r"local_alloc[^\n]*-> !ttg.memdesc<([^,>]*)", ttgir)
            copies = ttgir.count("async_copy_global_to_local")
            print(f"ahead {int(ahead)} stages {stages}: shared {kernel.metadata.shared} B, "
                  f"async copies {copies}, async_wait nums {waits}, buffers {buffers}")  # fmt: skip


if __name__ == "__main__":
    main()
