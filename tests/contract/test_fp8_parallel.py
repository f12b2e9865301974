"""Block-FP8 models under tensor and expert parallelism on the CPU (gloo): the block scales are
cut with their weights, and every degree gives TP 1's bits (lockstep/parallel/sharding.py,
`fp8_block_problem`; lockstep/models/blocks/prepare.py, `shard_fp8`, `fp8_pieces`).

* A block-FP8 DeepSeek-V3 folder, quantized as DeepSeek-V3's release is (every MLA
  projection, dense MLP, shared and routed expert), with widths whose reduction chunks and
  rank boundaries fall on 128 edges: TP 2 and EP 2 give TP 1's chunked bits, logits and KV,
  and the property suite holds at TP 2; with 4 heads, TP 4 too. Controls: TP 1's default
  reduction and reference mode at TP 2 differ.
* A block-FP8 Qwen3-MoE folder likewise at TP 2.
* Refused in one line with the arithmetic: a degree whose shard would split a scale block
  (heads of 64 columns in o_proj's chunks; experts of width 160, chunks of 20 columns), and
  FP8 schemes other than block at tp > 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.errors import ConfigError
from tests.support.parallel_cases import (
    check_property_cases,
    differing,
    engines_at,
    llm_at,
    random_sequences,
)
from tests.support.tiny_fp8 import write_fp8_folder

# Widths whose 8 reduction chunks and 2-rank boundaries fall on 128-wide scale blocks.
ALIGNED = {
    "deepseek_v3": dict(v_head_dim=128, intermediate_size=1024, moe_intermediate_size=1024),
    "qwen3_moe": dict(head_dim=128, intermediate_size=1024, moe_intermediate_size=1024),
}


def _folder(tmp_path_factory: pytest.TempPathFactory, family: str, **shape) -> Path:
    folder = tmp_path_factory.mktemp(f"fp8_{family}")
    write_fp8_folder(folder, "fp8-block", family=family, **shape)
    return folder


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory):
    folder = _folder(tmp_path_factory, "deepseek_v3", **ALIGNED["deepseek_v3"])
    with engines_at(folder) as found:
        yield found


def test_fp8_deepseek_v3_at_tp_2_and_ep_2_gives_the_bits_of_tp_1(deepseek) -> None:
    spec = deepseek[2].decoder.spec
    assert spec.fp8 is not None and spec.fp8.scheme == "block" and spec.mla is not None
    assert spec.is_fp8_linear("model.layers.1.mlp.experts.0.down_proj")
    sequences = random_sequences(3, 40, seed=8)
    for degree in (2, "ep2"):
        assert differing(deepseek[1], deepseek[degree], sequences) == [], degree
    assert differing(deepseek[1], deepseek["default"], sequences), "the control agreed"


def test_fp8_deepseek_v3_position_invariance_at_tp_2(deepseek) -> None:
    check_property_cases(deepseek[2], deepseek[1], range(200, 205))


def test_fp8_deepseek_v3_reference_mode_at_tp_2_changes_bits(deepseek) -> None:
    reference_mode = llm_at(deepseek[1].config.model, 2, mode="reference")
    try:
        assert differing(deepseek[1], reference_mode.engine, random_sequences(3, 40, seed=8))
    finally:
        reference_mode.close()


def test_fp8_deepseek_v3_at_tp_4_gives_the_bits_of_tp_1(tmp_path_factory) -> None:
    """4 heads of 128 value columns: o_proj's chunks and the 4 rank boundaries fall on 128
    edges."""
    folder = _folder(tmp_path_factory, "deepseek_v3", num_attention_heads=4,
                     **ALIGNED["deepseek_v3"])  # fmt: skip
    single, four = llm_at(folder, 1, tp_reduction="chunked"), llm_at(folder, 4)
    try:
        assert differing(single.engine, four.engine, random_sequences(3, 40, seed=8)) == []
    finally:
        single.close()
        four.close()


def test_fp8_qwen3_moe_at_tp_2_gives_the_bits_of_tp_1(tmp_path_factory) -> None:
    folder = _folder(tmp_path_factory, "qwen3_moe", **ALIGNED["qwen3_moe"])
    single, two = llm_at(folder, 1, tp_reduction="chunked"), llm_at(folder, 2)
    try:
        assert differing(single.engine, two.engine, random_sequences(3, 40, seed=9)) == []
    finally:
        single.close()
        two.close()


@pytest.mark.parametrize(
    ("fmt", "family", "shape", "needle"),
    [
        ("fp8-block", "qwen3_moe", {"head_dim": 64},
         "a shard would split an FP8 scale block: o_proj's input (256) would be cut at 64, "
         "not a multiple of 128; degrees that work: 1"),
        ("fp8-block", "qwen3_moe", {"head_dim": 128, "intermediate_size": 1024},
         "a shard would split an FP8 scale block: the expert width (160) would be cut at 20, "
         "not a multiple of 128; degrees that work: 1"),
        ("compressed-tensors", "qwen3", {},
         "channel-scaled FP8 models run at tp=1 only (block-FP8 ones shard); degrees that "
         "work: 1"),
    ],
)  # fmt: skip
def test_fp8_degrees_that_split_a_block_are_refused_in_one_line(
    tmp_path: Path, fmt: str, family: str, shape: dict, needle: str
) -> None:
    write_fp8_folder(tmp_path, fmt, family=family, **shape)
    with pytest.raises(ConfigError) as info:
        llm_at(tmp_path, 2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"tp=2 is invalid for {tmp_path.name}") and message.endswith(needle)
