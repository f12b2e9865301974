"""How Triton schedules a kernel's main loop, without a GPU: compile for sm_90 with the
installed Triton and print shared memory, the async copies, the `async_wait` counts (0 = the
next block's copies are waited for at the top of each iteration: no overlap) and the
shared-memory buffers (`2x64x128` = double-buffered).

    python scripts/kernel_schedule.py [--path split|prefill] [--stages 2,3,4] [--ahead 0,1]
        [--row-sum sum|mma] [--warps N]   (--warps: the split path's; prefill keeps 8)
    python scripts/kernel_schedule.py --matmul 16-32-256-4-5 [16-64-256-4-4-s ...]
    python scripts/kernel_schedule.py --merge [--stages 1,4,8] [--merge-cols 32] [--warps 1]

(`--matmul`: BM-BN-BK-WARPS-STAGES[-s] configs of the TMA matmul kernel, -s = one program per
K split. `--merge`: the split path's merge at a batch-1 decode tile (4 rows), with its loop's
pipeline stages; also the fold loop's instructions, stall cycles and scoreboard waits from
the SASS, where Triton's bundled disassembler is present.)

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


def compile_sm90(fn, types: dict, constexprs: dict, divisible: set, options: dict):
    """Compile `fn` for sm_90: `types` names each runtime argument's type (default i32),
    `divisible` the arguments the launcher would specialise as multiples of 16."""
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible}
    src = ASTSource(
        fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_attention(
    path: str, stages: int, ahead: bool, row_sum_mma: bool = False, split_warps: int = 1
):
    """The production tile of `path` (split: 16 rows on `split_warps` warps, 1 in the table;
    prefill: 128 rows on 8)."""
    rows, warps = (16, split_warps) if path == "split" else (128, 8)
    constexprs = {
        "HKV": 8, "G": 4, "ROWS": rows, "BLOCK_N": 64, "SPLIT": 512, "D": 128,
        "WRITE_PARTIALS": int(path == "split"), "WIDE": False, "ROW_SUM_MMA": row_sum_mma,
        "SLOTS_AHEAD": ahead, "PDL": True,
    }  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    return compile_sm90(attention._attn_fwd, {**POINTERS, "qk_scale": "fp32"}, constexprs,
                        DIVISIBLE, options)  # fmt: skip


def compile_matmul(text: str):
    """The non-persistent TMA matmul kernel at config BM-BN-BK-WARPS-STAGES[-s], bf16."""
    from lockstep.ops.triton import matmul

    parts = text.split("-")
    bm, bn, bk, warps, stages = map(int, parts[:5])
    constexprs = {
        "HAS_BIAS": False, "EVEN_K": True, "TMA": True, "SPLIT_PROGRAMS": parts[5:] == ["s"],
        "BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "PDL": True,
    }  # fmt: skip
    types = {"x": f"tensordesc<bf16[{bm},{bk}]>", "w": f"tensordesc<bf16[{bn},{bk}]>",
             "bias": "*bf16", "y": "*bf16", "ws": "*fp32", "counters": "*i32"}  # fmt: skip
    divisible = {"bias", "y", "ws", "counters", "N", "K", "SPLIT_LEN", "sxm", "swn", "sym"}
    return compile_sm90(matmul._matmul_kernel, types, constexprs, divisible,
                        {"num_warps": warps, "num_stages": stages})  # fmt: skip


def compile_merge(stages: int, cols: int, warps: int):
    """`_attn_merge` for a batch-1 Qwen3-8B decode (G 4, D 128), one wave, bf16 output."""
    constexprs = {
        "HKV": 8, "G": 4, "ROWS": 4, "SPLIT": 512, "D": 128, "DC": cols, "STAGES": stages,
        "FIRST": True, "LAST": True, "PDL": True,
    }  # fmt: skip
    state = {"st_m": "*fp32", "st_l": "*fp32", "st_acc": "*fp32"}  # the running state
    options = {"num_warps": warps, "num_stages": 1, "enable_fp_fusion": False}
    return compile_sm90(attention._attn_merge, {**POINTERS, **state}, constexprs,
                        DIVISIBLE | set(state), options)  # fmt: skip


def loop_summary(kernel) -> str:
    """Each SASS loop (a label up to a branch back to it), in program order: instructions,
    the control codes' stall cycles, and its scoreboard waits (a DEPBAR.LE with a count lets
    that many copies stay in flight; a wait mask on the loads' scoreboard waits for all)."""
    try:
        sass = kernel.asm["sass"]
    except Exception as e:  # noqa: BLE001 - the disassembler is optional
        return f"(no SASS: {e})"
    lines = [line.strip() for line in sass.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\w+):$", line))}
    # Loops of more than one instruction (the kernel ends in a one-branch trap loop).
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA (\w+);", line)) and labels.get(m.group(1), i) < i - 2]  # fmt: skip
    if not loops:
        return "(no loop in the SASS)"
    parts = []
    for lo, hi in sorted(loops):
        body = lines[lo + 1 : hi + 1]
        control = [re.match(r"^([0-9a-f-]{2}):[0-9-]:[0-9-]:[Y-]:([0-9a-f])\s", x) for x in body]
        stalls = sum(int(m.group(2), 16) for m in control if m)
        depbars = [x.split("DEPBAR")[1].strip(" ;") for x in body if "DEPBAR.LE" in x]
        masked = sum(1 for m in control if m and m.group(1) != "--")
        parts.append(f"loop {sum(1 for m in control if m)} instructions, {stalls} stall "
                     f"cycles, DEPBAR {depbars or 'none'}, {masked} with a wait mask")  # fmt: skip
    return "; ".join(parts)


def summary(kernel) -> str:
    ttgir = kernel.asm["ttgir"]
    waits = re.findall(r"async_wait[^\n]*num = (\d+)", ttgir)
    barrier_waits = ttgir.count("wait_barrier")
    buffers = re.findall(r"local_alloc[^\n]*-> !ttg.memdesc<([^,>]*)", ttgir)
    copies = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy")
    return (f"shared {kernel.metadata.shared} B, async copies {copies}, async_wait nums "
            f"{waits}, barrier waits {barrier_waits}, buffers {buffers}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", choices=("split", "prefill"), default="split")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--ahead", default="0,1", help="slot ids a block ahead: 0, 1 or both")
    ap.add_argument("--matmul", nargs="*", default=None, help="matmul configs instead")
    ap.add_argument("--merge", action="store_true", help="the split path's merge instead")
    ap.add_argument("--merge-cols", type=int, default=attention.DEFAULT_CONFIG.merge_cols)
    ap.add_argument(
        "--warps",
        type=int,
        default=None,
        help="the merge's or the split path's warps (default: the table's)",
    )
    ap.add_argument("--row-sum", choices=("sum", "mma"), default="sum")
    args = ap.parse_args()
    table = attention.DEFAULT_CONFIG
    if args.merge:
        warps = args.warps or table.merge_warps
        print(f"triton {triton.__version__}, sm_90, merge, {args.merge_cols} columns, "
              f"{warps} warps")  # fmt: skip
        for stages in map(int, args.stages.split(",")):
            kernel = compile_merge(stages, args.merge_cols, warps)
            print(f"stages {stages}: {summary(kernel)}; {loop_summary(kernel)}")
        return
    if args.matmul:
        print(f"triton {triton.__version__}, sm_90, TMA matmul")
        for text in args.matmul:
            print(f"{text}: {summary(compile_matmul(text))}")
        return
    warps = args.warps or table.num_warps_split
    print(f"triton {triton.__version__}, sm_90, {args.path} path, row sum {args.row_sum}"
          + (f", {warps} warps" if args.path == "split" else ""))  # fmt: skip
    for ahead in (bool(int(a)) for a in args.ahead.split(",")):
        for stages in map(int, args.stages.split(",")):
            kernel = compile_attention(args.path, stages, ahead, args.row_sum == "mma", warps)
            print(f"ahead {int(ahead)} stages {stages}: {summary(kernel)}; {loop_summary(kernel)}")


if __name__ == "__main__":
    main()
