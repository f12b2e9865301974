"""Kernels compiled for the H200 (sm_90) on a machine without a GPU: Triton's front end and
its CUDA back end run on the CPU, so a kernel that the interpreter runs but the compiler
refuses (a type the interpreter never checks) fails here, in CI, rather than on the GPU.

Covers the specializations an engine launch asks for that the GPU tests could miss: the
attention input and attention kernels with an FP8 (e4m3) KV cache and with a bf16 one (decode
and prefill tiles, Qwen3.5's head_dim 256), and the gated delta rule (the per-row kernel and
the chunked one's three) at Qwen3.5's head sizes, MLA's cache-row and query kernels, and the
training module's fused row-op backwards (RMSNorm, SiLU-mul, the LM head's dlogits). And one layout the bits depend on: the decode tiles' dots over an FP8 cache must be laid out
as over a bf16 cache (`attention.widen_kv` says why), which the interpreter cannot show.
The compiles run in one child process: the test session runs Triton's interpreter
(TRITON_INTERPRET=1, conftest.py), under which kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CACHES = ("*bf16", "*fp8e4nv")


def _attention_input(cache: str) -> tuple[str, dict, dict]:
    types = dict.fromkeys(("qkv", "q_out", "q_norm", "k_norm"), "*bf16")
    types |= {"k_cache": cache, "v_cache": cache, "positions": "*i64", "slots": "*i64",
              "cos": "*fp32", "sin": "*fp32", "eps": "fp32", "k_scale": "fp32", "v_scale": "fp32",
              "HQ": "i32", "HKV": "i32"}  # fmt: skip
    types |= dict.fromkeys(("sqkv", "sqt", "sqh", "skc", "skh", "svc", "svh", "sc"), "i64")
    return "attention_input._attention_input_kernel", types, {"HALF": 64, "HAS_NORM": True,
                                                              "PDL": True}  # fmt: skip


def _attention(
    cache: str, d: int, write_partials: int, q: str = "*bf16", decode_tiles: bool = False
) -> tuple[str, dict, dict]:
    from lockstep.ops.triton.attention import DEFAULT_CONFIG as cfg

    types = {"q": q, "k_cache": cache, "v_cache": cache, "out": q,
             "ws_m": "*fp32", "ws_l": "*fp32", "ws_acc": "*fp32", "qk_scale": "fp32",
             "window": "i32"}  # fmt: skip
    types |= dict.fromkeys(("cu_q", "q_start", "cu_kv", "slot_table"), "*i32")
    types |= dict.fromkeys(("wave_base", "R", "sqt", "sqh", "skc", "skh", "sot", "soh"), "i32")
    rows = cfg.rows_split if write_partials or decode_tiles else cfg.rows
    constexprs = {"HKV": 4, "G": 4, "ROWS": rows, "BLOCK_N": cfg.block_n, "SPLIT": cfg.split,
                  "D": d, "WRITE_PARTIALS": write_partials, "WIDE": False,
                  "SLOTS_AHEAD": False, "PDL": False}  # fmt: skip
    return "attention._attn_fwd", types, constexprs


def _latent(cache: str, path: str, q: str = "*bf16", wide: bool = False) -> tuple[str, dict, dict]:
    """Latent attention at DeepSeek-V2-Lite's widths (16 heads, W = 512 + 64) on each path,
    with the launch options of its config (`LATENT_OPTIONS`); `wide`: 64-bit cache offsets
    (a pool past 2**31 elements, e.g. an FP8 latent cache of V2-Lite at the default fraction)."""
    from lockstep.ops.triton.latent_attention import DEFAULT_LATENT_CONFIG as cfg

    types = {"q": q, "cache": cache, "out": q, "ws_m": "*fp32", "ws_l": "*fp32",
             "ws_acc": "*fp32", "qk_scale": "fp32"}  # fmt: skip
    types |= dict.fromkeys(("cu_q", "q_start", "cu_kv", "slot_table"), "*i32")
    types |= dict.fromkeys(("wave_base", "R", "sqt", "sqh", "sc", "sot", "soh"), "i32")
    prefill = path == "prefill"
    constexprs = {"H": 16, "ROWS": cfg.rows if prefill else cfg.rows_split,
                  "BLOCK_N": cfg.block_n, "SPLIT": cfg.split, "DL": 512, "DR": 64,
                  "DVC": cfg.value_cols if prefill else 512,
                  "WRITE_PARTIALS": int(path == "split"), "WIDE": wide, "PDL": True}  # fmt: skip
    return "latent_attention._latent_fwd", types, constexprs


def _latent_options(path: str) -> dict:
    """The latent kernel's launch options on an H200 (`latent_attention.latent_attention`:
    the config's stages, 1 beside a prefill tile's q rows and 2 beside a decode tile's, what
    `stages_that_fit` allows)."""
    from lockstep.ops.triton.latent_attention import DEFAULT_LATENT_CONFIG as cfg

    prefill = path == "prefill"
    return {"num_warps": cfg.num_warps if prefill else cfg.num_warps_split,
            "num_stages": cfg.num_stages if prefill else cfg.num_stages_split,
            "enable_fp_fusion": False}  # fmt: skip


def _latent_row(cache: str, act: str = "*bf16") -> tuple[str, dict, dict]:
    """MLA's cache row (`latent_input.write_latent_row`) at DeepSeek-V2-Lite's widths (latent
    512, RoPE 64): bf16 activations into a bf16 or e4m3 cache."""
    types = {"latent": act, "k_rope": act, "cache": cache, "positions": "*i64", "slots": "*i64",
             "cos": "*fp32", "sin": "*fp32"}  # fmt: skip
    types |= dict.fromkeys(("s_lat", "s_rope", "s_cache", "s_cos"), "i64")
    return "latent_input._latent_row_kernel", types, {"R": 512, "HALF": 32, "BLOCK_R": 512,
                                                      "BLOCK_H": 32, "PDL": True}  # fmt: skip


def _latent_query() -> tuple[str, dict, dict]:
    """MLA's absorbed query (`latent_input.latent_query`), bf16, V2-Lite's widths."""
    types = {"q_lat": "*bf16", "q_rope": "*bf16", "out": "*bf16", "positions": "*i64",
             "cos": "*fp32", "sin": "*fp32"}  # fmt: skip
    types |= dict.fromkeys(("s_lt", "s_lh", "s_rt", "s_rh", "s_ot", "s_oh", "s_cos"), "i64")
    return "latent_input._latent_query_kernel", types, {"R": 512, "HALF": 32, "BLOCK_R": 512,
                                                        "BLOCK_H": 32, "PDL": True}  # fmt: skip


def _route_deepseek(groups: int, top2: bool, softmax: bool) -> tuple[str, dict, dict]:
    """DeepSeek routing: V3's 256 experts in 8 groups (top-2 sums, sigmoid), V2-Lite's 64
    (softmax, one group)."""
    types = {"logits": "*fp32", "bias": "*fp32", "experts": "*i64", "weights": "*fp32",
             "E": "i32", "sl": "i32", "routed_scaling": "fp32"}  # fmt: skip
    e = 256 if groups > 1 else 64
    return "moe._route_deepseek_kernel", types, {
        "TOP_K": 8 if groups > 1 else 6, "K_PAD": 8, "RENORMALIZE": groups > 1,
        "SOFTMAX": softmax, "HAS_BIAS": not softmax, "GROUPS": groups, "G_PAD": max(2, groups),
        "TOPK_GROUPS": 4 if groups > 1 else 1, "TOP2": top2, "E_PAD": e, "PDL": True,
    }  # fmt: skip


def _gated_delta() -> tuple[str, dict, dict]:
    pointers = ("q", "k", "v", "g", "beta", "state", "open_k", "open_gamma", "open_u", "out",
                "bounds")  # fmt: skip
    types = dict.fromkeys(pointers, "*fp32")
    types |= dict.fromkeys(("cu", "starts", "slots", "bound_at", "bound_index"), "*i32")
    types |= dict.fromkeys(("s_slot", "k_slot", "g_slot", "u_slot", "HK", "HV", "DK", "DV"), "i32")
    return "gated_delta._gdn_rule_kernel", types, {"C": 32, "BK": 128, "BV": 32, "PDL": True}


def _chunked_delta(kernel: str) -> tuple[str, dict, dict]:
    """The chunked rule's kernels at Qwen3.5's head sizes (C = 32, Dk = Dv = 128), as
    chunked_delta_rule_pooled launches them."""
    from lockstep.ops.triton.chunked_delta import BLOCK_V, DOT_PRECISION, KB

    pointers = ("q", "k", "v", "g", "beta", "state", "open_k", "open_v", "open_g", "open_beta",
                "ws_w", "ws_u", "ws_gamma", "ws_p", "out", "bounds")  # fmt: skip
    types = dict.fromkeys(pointers, "*fp32")
    types |= dict.fromkeys(("task_seq", "task_pos", "task_row", "task_n", "task_cu", "starts",
                            "ends", "slots", "bound_at", "bound_index"), "*i32")  # fmt: skip
    types |= dict.fromkeys(("s_slot", "k_slot", "v_slot", "g_slot", "b_slot", "HK", "HV", "DK",
                            "DV"), "i32")  # fmt: skip
    constexprs = {"C": 32, "PDL": True}
    if kernel == "_gdn_open_rows_kernel":
        constexprs |= {"BK": 128, "BVF": 128}
    else:
        constexprs |= {"PREC": DOT_PRECISION, "KB": KB, "NKB": 128 // KB}
    if kernel == "_gdn_chunk_state_kernel":
        constexprs["BV"] = BLOCK_V
    if kernel == "_gdn_chunk_wy_kernel":
        constexprs |= {"VB": KB, "NVB": 128 // KB}
    return f"chunked_delta.{kernel}", types, constexprs


# (M, N, K) of the grouped matmul cases: DeepSeek's W_UK at decode, W_UV at batch 256.
GROUPED_MATMULS = {"grouped matmul w_uk m=1": (1, 512, 128),
                   "grouped matmul w_uv m=256": (256, 128, 512)}  # fmt: skip


def _grouped_matmul(m: int, n: int, k: int) -> tuple[str, dict, dict]:
    """MLA's absorbed projections in one launch (`matmul.grouped_matmul`), bf16, with the
    table's config for (m, n, k): DeepSeek's W_UK (n 512, k 128) and W_UV (n 128, k 512)."""
    from lockstep.ops.triton.matmul import pick_config

    cfg = pick_config(m, n, k)
    types = {"x": "*bf16", "w": "*bf16", "y": "*bf16"}
    types |= dict.fromkeys(("M", "N", "K", "SPLIT_LEN", "NUM_SPLITS", "sxm", "sxg", "swn", "swg",
                            "sym", "syg"), "i32")  # fmt: skip
    return "matmul._grouped_matmul_kernel", types, {
        "EVEN_K": k % cfg.bk == 0, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk,
        "GROUP_M": cfg.group_m, "PDL": True,
    }  # fmt: skip


def _widened_dot() -> tuple[str, dict, dict]:
    """The layout control: a dot over e4m3 values widened by a plain conversion."""
    return "widened_dot", {"q": "*bf16", "k": "*fp8e4nv", "out": "*fp32"}, {}


def _two_ways() -> tuple[str, dict, dict]:
    """The negative control: a variable that is a bf16 pointer in one branch and an e4m3
    pointer in the other (what the attention input kernel had) must be refused."""
    return "two_ways", {"a": "*bf16", "b": "*fp8e4nv", "n": "i32"}, {}


def _fp8_grouped_moe(row_block: int = 128) -> tuple[str, dict, dict]:
    """The grouped FP8 MoE GEMM as `moe_fp8` launches its gate_up: gathered e4m3 rows, gate
    and up in one program, SiLU in the epilogue, Qwen3-30B-A3B's top 8 of 128 experts;
    `row_block` 128 for block scales, 1 for per-row ones (per-channel and per-tensor)."""
    types = {"a": "*fp8e4nv", "a_scale": "*fp32", "w": "*fp8e4nv", "w_scale": "*fp32",
             "out": "*bf16", "order": "*i64", "offsets": "*i64"}  # fmt: skip
    types |= dict.fromkeys(("N", "K", "E", "M_TILES", "UP_ROWS", "sa", "s_as", "s_ask", "swe",
                            "swn", "s_wse", "s_wsn", "s_wsk", "so"), "i32")  # fmt: skip
    return "fp8_moe._grouped_fp8_kernel", types, {
        "GATHER": True, "SCATTER": False, "SILU": True, "TOP_K": 8, "EVEN_K": True,
        "E_PAD": 128, "BM": 64, "BN": 64, "BK": 128, "ROW_BLOCK": row_block, "PDL": True,
    }  # fmt: skip


def _training_rms_norm_backward() -> tuple[str, dict, dict]:
    """The training module's fused RMSNorm backward (lockstep/ops/triton/row_grads.py) on bf16
    rows of Qwen3-8B's hidden size, with the residual stream's gradient."""
    from lockstep.ops.triton.row_grads import ROWS

    types = dict.fromkeys(("x", "dy", "ds", "dx"), "*bf16") | {"w": "*fp32", "dw_part": "*fp32"}
    types |= dict.fromkeys(("n_rows", "hidden", "sx", "sdy", "sds", "sdx"), "i32")
    types["eps"] = "fp32"
    return "row_grads._rms_norm_backward_kernel", types, {"HAS_DS": True, "ROWS": ROWS,
                                                           "BLOCK": 4096, "PDL": False}  # fmt: skip


def _training_silu_mul_backward() -> tuple[str, dict, dict]:
    """The training module's fused SiLU-mul backward on bf16 rows."""
    from lockstep.ops.triton.row_grads import SILU_BLOCK

    types = dict.fromkeys(("gu", "dy", "dgu"), "*bf16")
    types |= dict.fromkeys(("inter", "sgu", "sdy", "sdgu"), "i32")
    return "row_grads._silu_mul_backward_kernel", types, {"BLOCK": SILU_BLOCK, "PDL": False}


def _training_head_dlogits(cap: bool) -> tuple[str, dict, dict]:
    """The training module's fused dlogits of the LM head (bf16 logits and gradient), with
    and without soft-capping."""
    from lockstep.ops.triton.row_grads import SILU_BLOCK

    types = {"z": "*bf16", "lse": "*fp32", "g": "*fp32", "targets": "*i64", "dz": "*bf16",
             "cap": "fp32"}  # fmt: skip
    types |= dict.fromkeys(("cols", "lo", "sz", "sdz"), "i32")
    return (
        "row_grads._head_dlogits_kernel",
        types,
        {"HAS_CAP": cap, "BLOCK": SILU_BLOCK, "PDL": False},
    )


def _training_attention_input_backward() -> tuple[str, dict, dict]:
    """The training module's fused attention-input backward
    (lockstep/ops/triton/attention_input_grad.py) on bf16 rows with head norms, head_dim 128."""
    from lockstep.ops.triton.attention_input_grad import ROWS

    types = dict.fromkeys(("x", "dy", "dx"), "*bf16") | {"w": "*fp32", "dw_part": "*fp32",
                                                          "positions": "*i64", "cos": "*fp32",
                                                          "sin": "*fp32", "eps": "fp32"}  # fmt: skip
    types |= dict.fromkeys(("n_rows", "col0", "head_dim", "rot", "sx", "sdy_row", "sdy_head",
                            "sdx", "scos"), "i32")  # fmt: skip
    return "attention_input_grad._head_input_backward_kernel", types, {
        "HAS_NORM": True, "ROWS": ROWS, "BLOCK": 128, "PDL": False}  # fmt: skip


def _target_log_softmax() -> tuple[str, dict, dict]:
    """The training head's target log-softmax (lockstep/ops/triton/log_softmax.py) over
    float32 logits of a 151,936 vocabulary (38 chunk partials)."""
    types = {"x": "*fp32", "targets": "*i64", "y": "*fp32", "lse_out": "*fp32",
             "part_m": "*fp32", "part_s": "*fp32", "sx": "i32", "C": "i32"}  # fmt: skip
    return "log_softmax._target_output", types, {"C_POW2": 64, "PDL": False}


CASES = {
    **{f"attention_input {c}": _attention_input(c) for c in CACHES},
    "target log_softmax": _target_log_softmax(),
    "training attention_input backward": _training_attention_input_backward(),
    "training rms_norm backward": _training_rms_norm_backward(),
    "training silu_mul backward": _training_silu_mul_backward(),
    "training head dlogits": _training_head_dlogits(False),
    "training head dlogits softcap": _training_head_dlogits(True),
    **{
        f"attention {c} d={d} partials={p}": _attention(c, d, p)
        for c in CACHES
        for d, p in ((128, 0), (128, 1), (256, 0))
    },
    **{
        f"latent attention {c} {p}": _latent(c, p)
        for c in CACHES
        for p in ("prefill", "fold", "split")
    },  # fmt: skip
    "latent attention wide *fp8e4nv split": _latent("*fp8e4nv", "split", wide=True),
    **{f"mla cache row {c}": _latent_row(c) for c in CACHES},
    "mla cache row *fp32 into *bf16": _latent_row("*bf16", "*fp32"),
    "mla query": _latent_query(),
    "deepseek routing v3": _route_deepseek(8, True, False),
    "deepseek routing v2-lite": _route_deepseek(1, False, True),
    "gated delta rule": _gated_delta(),
    "chunked delta rule wy": _chunked_delta("_gdn_chunk_wy_kernel"),
    "chunked delta rule state and output": _chunked_delta("_gdn_chunk_state_kernel"),
    "chunked delta rule open rows": _chunked_delta("_gdn_open_rows_kernel"),
    "fp8 grouped moe gate_up": _fp8_grouped_moe(),
    **{name: _grouped_matmul(*mnk) for name, mnk in GROUPED_MATMULS.items()},
    "fp8 grouped moe gate_up per-row scales": _fp8_grouped_moe(1),
    "negative control": _two_ways(),
}
_STRIDES = ("sqt", "sqh", "skc", "skh", "sot", "soh", "sc")
# Decode tiles as the engine launches them (num_warps_split warps): the dots' operand layouts.
LAYOUTS = {
    **{
        f"decode tiles {c} q {q} partials={p}": _attention(c, 128, p, q, decode_tiles=True)
        for c in (*CACHES, "*fp32")
        for q in ("*bf16", "*fp32")
        for p in (0, 1)
        if c in (q, "*fp8e4nv") and (q == "*bf16" or p)
    },
    **{
        f"latent decode tiles {c} partials={p}": _latent(c, ("fold", "split")[p])
        for c in CACHES
        for p in (0, 1)
    },  # fmt: skip
    "widened dot (control)": _widened_dot(),
}
# MLA's RoPE kernels with contraction off (as launched) and on (the control): the count of
# float32 FMAs in the PTX. Their bits are the composed torch ops', one rounding per product.
CONTRACTIONS = {
    **{f"fma {case}": (case, False) for case in ("mla cache row *bf16", "mla query")},
    "fma mla query contraction on (control)": ("mla query", True),
}
# Shared memory one program may use on an H100/H200 (the opt-in limit).
SM90_SHARED = 232448


def _compile_all(names: list[str]) -> dict[str, str]:
    """Child process: compile each case for sm_90: "ok" or the error's last line; for the
    LAYOUTS cases, the kWidth of every dot operand in the compiled TTGIR, joined by commas."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.ops.triton import (
        attention,
        attention_input,
        chunked_delta,
        fp8_moe,
        gated_delta,
        latent_attention,
        latent_input,
        log_softmax,
        matmul,
        moe,
    )

    @triton.jit
    def widened_dot(q, k, out):
        offs_m = tl.arange(0, 16)
        offs_n = tl.arange(0, 64)
        offs_d = tl.arange(0, 128)
        qt = tl.load(q + offs_m[:, None] * 128 + offs_d[None, :])
        kt = tl.load(k + offs_n[:, None] * 128 + offs_d[None, :]).to(tl.bfloat16)
        s = tl.dot(qt, tl.trans(kt))
        tl.store(out + offs_m[:, None] * 64 + offs_n[None, :], s)

    @triton.jit
    def two_ways(a, b, n):
        if n > 0:
            dst = a
        else:
            dst = b
        tl.store(dst, 0.0)

    from lockstep.ops.triton import attention_input_grad, row_grads

    modules = {"attention": attention, "attention_input": attention_input,
               "gated_delta": gated_delta, "chunked_delta": chunked_delta, "fp8_moe": fp8_moe,
               "latent_attention": latent_attention, "latent_input": latent_input,
               "matmul": matmul, "moe": moe,
               "row_grads": row_grads, "attention_input_grad": attention_input_grad,
               "log_softmax": log_softmax}  # fmt: skip
    local = {"two_ways": two_ways, "widened_dot": widened_dot}
    results = {}
    for name in names:
        case, fusion = CONTRACTIONS.get(name, (name, False))
        path, types, constexprs = CASES[case] if case in CASES else LAYOUTS[case]
        mod, _, attr = path.rpartition(".")
        kernel = getattr(modules[mod], attr) if mod else local[path]
        signature = {a: types.get(a, "constexpr") for a in kernel.arg_names}
        options, aligned = {}, {}
        if name.startswith("latent"):
            options = _latent_options(name.rpartition(" ")[2] if name in CASES else "fold")
        if case.startswith("mla"):  # as latent_input launches them: contraction off
            options = {"num_warps": 4 if "row" in case else 2, "enable_fp_fusion": fusion}
        if name in GROUPED_MATMULS:  # the table config's warps and stages
            cfg = matmul.pick_config(*GROUPED_MATMULS[name])
            options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if name in LAYOUTS:  # as the engine launches them: decode tiles on num_warps_split
            # warps, contraction off (attention._launch_opts), pointers and strides
            # 16-divisible (Triton specializes them so at launch)
            options = options or {"num_warps": attention.DEFAULT_CONFIG.num_warps_split,
                                  "enable_fp_fusion": False}  # fmt: skip
            aligned = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]]
                       for a, t in types.items() if t.startswith("*") or a in _STRIDES}  # fmt: skip
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned),
                target=GPUTarget("cuda", 90, 32), options=options,
            )  # fmt: skip
        except Exception as exc:  # reported to the parent
            results[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            continue
        if name in CONTRACTIONS:
            results[name] = str(len(re.findall(r"\bfma\.rn\.f32\b", compiled.asm["ptx"])))
        elif name in LAYOUTS:
            results[name] = ",".join(re.findall(r"kWidth = (\d+)", compiled.asm["ttgir"]))
        elif "cubin" not in compiled.asm:
            results[name] = "no cubin"
        elif compiled.metadata.shared > SM90_SHARED:
            results[name] = f"shared memory {compiled.metadata.shared} > {SM90_SHARED}"
        else:
            results[name] = "ok"
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, *CASES, *LAYOUTS, *CONTRACTIONS], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in CASES if n != "negative control"])
def test_kernel_compiles_for_sm90(compiled: dict[str, str], name: str) -> None:
    assert compiled[name] == "ok", compiled[name]


@pytest.mark.parametrize(("q", "partials"), [("*bf16", 0), ("*bf16", 1), ("*fp32", 1)])
def test_decode_tile_dots_over_an_fp8_cache_are_laid_out_as_over_the_q_dtype(
    compiled: dict[str, str], q: str, partials: int
) -> None:
    """Every dot operand's kWidth as with a cache of q's dtype: the same K order in every
    MMA instruction, so decode tiles keep the prefill tiles' bits over an FP8 cache. (The
    FP8 kernel has more dot-operand layouts than the other: p's rescaling before p @ V runs
    in one, `attention.widen_kv` says why; what must match is the widths they use.)"""
    fp8 = compiled[f"decode tiles *fp8e4nv q {q} partials={partials}"]
    same = compiled[f"decode tiles {q} q {q} partials={partials}"]
    assert fp8 and same and "error" not in fp8.lower(), (fp8, same)
    assert set(fp8.split(",")) == set(same.split(",")), (fp8, same)


@pytest.mark.parametrize("partials", [0, 1])
def test_latent_decode_tile_dots_over_an_fp8_cache_are_laid_out_as_over_bf16(
    compiled: dict[str, str], partials: int
) -> None:
    """The same layout rule for the latent kernel's decode tiles (fold and split paths)."""
    fp8 = compiled[f"latent decode tiles *fp8e4nv partials={partials}"]
    same = compiled[f"latent decode tiles *bf16 partials={partials}"]
    assert fp8 and same and "error" not in fp8.lower(), (fp8, same)
    assert set(fp8.split(",")) == set(same.split(",")), (fp8, same)


@pytest.mark.parametrize("case", ["mla cache row *bf16", "mla query"])
def test_mla_rope_kernels_compile_without_fma(compiled: dict[str, str], case: str) -> None:
    """No product of the RoPE is fused into an add: the composed torch ops round each."""
    assert compiled[f"fma {case}"] == "0", compiled[f"fma {case}"]


def test_contraction_control_the_compiler_fuses_rope_products_when_allowed(
    compiled: dict[str, str],
) -> None:
    """The control: with contraction on, the same kernel's PTX has FMAs, so the count above
    sees them."""
    count = compiled["fma mla query contraction on (control)"]
    assert count.isdigit() and int(count) > 0, count


def test_layout_control_a_plain_widening_changes_the_dot_layout(compiled: dict[str, str]) -> None:
    """The control: a dot over e4m3 values widened by .to(bf16) gets 4 consecutive K
    elements per thread (kWidth 4), where bf16 values get 2: what widen_kv avoids."""
    assert set(compiled["widened dot (control)"].split(",")) == {"4"}


def test_negative_control_a_branch_typed_two_ways_is_refused(compiled: dict[str, str]) -> None:
    assert "Mismatched type" in compiled["negative control"], compiled["negative control"]


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1:])))
