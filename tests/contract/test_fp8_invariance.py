"""The position-invariance property suite (test_position_invariance.py) on the FP8 presets,
with the FP8 KV cache off and on (and the FP8 cache under unquantized weights): random schedules (prefix hits, chunkings, decode steps,
batch-mates) and prefix hits of every length give the bits of one cold full prefill, logits
and K/V entries. Negative controls: reference mode fails the property, and so does the
deterministic backend with only its FP8 linear replaced by the stock one (the suite sees the
FP8 arithmetic, not only attention's)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_position_invariance import (
    _SETTINGS,
    LONG,
    _batch_invariance_failures,
    _check_case,
    _engine,
    _prefix_hit_at_every_offset,
)

from lockstep.cache.kv_pool import KVPool
from lockstep.config import EngineConfig
from lockstep.engine import memory
from lockstep.engine.engine import Engine
from lockstep.errors import ConfigError
from lockstep.models.presets import PRESETS
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.cpu_stock import CpuStockOps
from lockstep.ops.fp8 import E4M3, Fp8Weight

BLOCK, STATIC, CHANNEL = (f"random:tiny-qwen3-fp8{s}" for s in ("", "-static", "-channel"))
CASES = 200 if LONG else 12


@pytest.fixture(scope="module")
def block_fp8_kv() -> Engine:
    engine = _engine(BLOCK, kv_dtype="fp8_e4m3")
    assert engine.pool.k_cache(0).dtype == E4M3
    assert isinstance(engine.decoder.layers[0].mixer.qkv, Fp8Weight)
    return engine


@settings(max_examples=CASES, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_block_fp8_with_fp8_kv_matches_cold_prefill(block_fp8_kv: Engine, seed: int) -> None:
    _check_case(block_fp8_kv, seed, max_len=120, max_mates=3)


@pytest.mark.parametrize(
    ("model", "kv_dtype"), [(BLOCK, "auto"), (STATIC, "auto"), (STATIC, "fp8_e4m3"),
                            (CHANNEL, "auto"), (CHANNEL, "fp8_e4m3"), ("random:tiny", "fp8_e4m3")],
)  # fmt: skip
def test_every_fp8_scheme_and_kv_dtype_keeps_the_contract(model: str, kv_dtype: str) -> None:
    engine = _engine(model, kv_dtype=kv_dtype)
    for seed in range(5):
        _check_case(engine, seed, max_len=90, max_mates=3)


def test_prefix_hit_at_every_offset_fp8(block_fp8_kv: Engine) -> None:
    """Hits of every length 1..n-1 over the FP8 cache (past the CPU's 32-key block): a hit
    reads what the cold prefill wrote, e4m3 for e4m3."""
    _prefix_hit_at_every_offset(block_fp8_kv, 48)


def test_prefix_hit_at_every_offset_fp8_static() -> None:
    _prefix_hit_at_every_offset(_engine(STATIC), 40)


def test_fp8_kv_cache_holds_twice_a_bf16_caches_tokens() -> None:
    """--kv-dtype fp8_e4m3 stores a byte per value: the engine sizes its pool by that (a
    quarter of the float32 cache's bytes per token here), and on an H200-sized budget the
    Qwen3-8B shape gets twice the bf16 cache's tokens in the same memory."""
    fp8 = _engine(BLOCK, kv_dtype="fp8_e4m3", kv_tokens=None, kv_memory_fraction=0.001)
    wide = _engine(BLOCK, kv_tokens=None, kv_memory_fraction=0.001)
    assert fp8.kv_budget.bytes_per_token * 4 == wide.kv_budget.bytes_per_token
    spec = PRESETS["qwen3-8b-fp8"].spec
    tokens = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        config = EngineConfig(model="random:qwen3-8b-fp8", device="cuda", kv_dtype=kv_dtype)
        dtype = getattr(torch, config.resolved_kv_dtype)
        per_token = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype)
        reserved = memory.step_workspace(spec, 2, 8192, 256, None)
        tokens[kv_dtype] = memory.cuda_kv_budget(120 << 30, per_token, reserved, 0.9).kv_tokens
    assert tokens["auto"] * 2 <= tokens["fp8_e4m3"] <= tokens["auto"] * 2 + 1


def test_kv_dtype_is_validated() -> None:
    with pytest.raises(ConfigError, match="kv_dtype='int8' is invalid: expected one of auto, fp8"):
        EngineConfig(kv_dtype="int8")


def test_negative_control_reference_mode_breaks_fp8_invariance() -> None:
    assert _batch_invariance_failures(_engine(BLOCK, mode="reference", kv_dtype="fp8_e4m3")) > 0


def test_negative_control_stock_fp8_linear_breaks_invariance() -> None:
    """Deterministic everything, except the FP8 linear through F.linear (oneDNN, whose row
    bits change with M when it splits the work over threads): the property fails, so it sees
    the FP8 GEMM. Two threads, given: on one, oneDNN's rows happen to keep their bits, and the
    engine's thread governor (lockstep/cpu_threads.py) gives up a thread when another test
    process keeps a core busy."""

    class StockFp8(CpuDeterministicOps):
        def fp8_linear(self, x, weight, bias=None):
            return CpuStockOps.fp8_linear(CpuStockOps(), x, weight, bias)

    engine = _engine(BLOCK, num_threads=2)
    engine.decoder.ops = StockFp8()
    assert _batch_invariance_failures(engine) > 0, "stock FP8 linear passed: the check is blind"
