"""Kernels compiled for the H200 (sm_90) on a machine without a GPU: Triton's front end and
its CUDA back end run on the CPU, so a kernel that the interpreter runs but the compiler
refuses (a type the interpreter never checks) fails here, in CI, rather than on the GPU.

Covers the specializations an engine launch asks for that the GPU tests could miss: the
attention input and attention kernels with an FP8 (e4m3) KV cache and with a bf16 one (decode
and prefill tiles, Qwen3.5's head_dim 256), and the gated delta rule at Qwen3.5's head sizes.
The compiles run in one child process: the test session runs Triton's interpreter
(TRITON_INTERPRET=1, conftest.py), under which kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CACHES = ("*bf16", "*fp8e4nv")


def _attention_input(cache: str) -> tuple[str, dict, dict]:
    types = dict.fromkeys(("qkv", "q_out", "q_norm", "k_norm"), "*bf16")
    types |= {"k_cache": cache, "v_cache": cache, "positions": "*i64", "slots": "*i64",
              "cos": "*fp32", "sin": "*fp32", "eps": "fp32", "HQ": "i32", "HKV": "i32"}  # fmt: skip
    types |= dict.fromkeys(("sqkv", "sqt", "sqh", "skc", "skh", "svc", "svh", "sc"), "i64")
    return "attention_input._attention_input_kernel", types, {"HALF": 64, "HAS_NORM": True,
                                                              "PDL": True}  # fmt: skip


def _attention(cache: str, d: int, write_partials: int) -> tuple[str, dict, dict]:
    from lockstep.ops.triton.attention import DEFAULT_CONFIG as cfg

    types = {"q": "*bf16", "k_cache": cache, "v_cache": cache, "out": "*bf16",
             "ws_m": "*fp32", "ws_l": "*fp32", "ws_acc": "*fp32", "qk_scale": "fp32"}  # fmt: skip
    types |= dict.fromkeys(("cu_q", "q_start", "cu_kv", "slot_table"), "*i32")
    types |= dict.fromkeys(("wave_base", "R", "sqt", "sqh", "skc", "skh", "sot", "soh"), "i32")
    rows = cfg.rows_split if write_partials else cfg.rows
    constexprs = {"HKV": 4, "G": 4, "ROWS": rows, "BLOCK_N": cfg.block_n, "SPLIT": cfg.split,
                  "D": d, "WRITE_PARTIALS": write_partials, "WIDE": False, "ROW_SUM_MMA": True,
                  "SLOTS_AHEAD": False, "PDL": False}  # fmt: skip
    return "attention._attn_fwd", types, constexprs


def _gated_delta() -> tuple[str, dict, dict]:
    pointers = ("q", "k", "v", "g", "beta", "state", "open_k_in", "open_gamma_in", "open_k",
                "open_gamma", "open_u", "out", "bounds")  # fmt: skip
    types = dict.fromkeys(pointers, "*fp32")
    types |= dict.fromkeys(("n", "start", "first_boundary", "HK", "HV", "DK", "DV"), "i32")
    return "gated_delta._gdn_rule_kernel", types, {"C": 32, "BK": 128, "BV": 32, "PDL": True}


def _two_ways() -> tuple[str, dict, dict]:
    """The negative control: a variable that is a bf16 pointer in one branch and an e4m3
    pointer in the other (what the attention input kernel had) must be refused."""
    return "two_ways", {"a": "*bf16", "b": "*fp8e4nv", "n": "i32"}, {}


CASES = {
    **{f"attention_input {c}": _attention_input(c) for c in CACHES},
    **{f"attention {c} d={d} partials={p}": _attention(c, d, p)
       for c in CACHES for d, p in ((128, 0), (128, 1), (256, 0))},  # fmt: skip
    "gated delta rule": _gated_delta(),
    "negative control": _two_ways(),
}


def _compile_all(names: list[str]) -> dict[str, str]:
    """Child process: compile each case for sm_90; "ok" or the error's last line."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.ops.triton import attention, attention_input, gated_delta

    @triton.jit
    def two_ways(a, b, n):
        if n > 0:
            dst = a
        else:
            dst = b
        tl.store(dst, 0.0)

    modules = {"attention": attention, "attention_input": attention_input,
               "gated_delta": gated_delta}  # fmt: skip
    results = {}
    for name in names:
        path, types, constexprs = CASES[name]
        mod, _, attr = path.rpartition(".")
        kernel = getattr(modules[mod], attr) if mod else two_ways
        signature = {a: types.get(a, "constexpr") for a in kernel.arg_names}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32))  # fmt: skip
            results[name] = "ok" if "cubin" in compiled.asm else "no cubin"
        except Exception as exc:  # reported to the parent
            results[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in CASES if n != "negative control"])
def test_kernel_compiles_for_sm90(compiled: dict[str, str], name: str) -> None:
    assert compiled[name] == "ok", compiled[name]


def test_negative_control_a_branch_typed_two_ways_is_refused(compiled: dict[str, str]) -> None:
    assert "Mismatched type" in compiled["negative control"], compiled["negative control"]


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1:])))
