"""Every family the engine serves is trainable: one row per tiny folder written by transformers
(tests/support/tiny_hf.py), each showing what training promises (docs/training.md):

  * the packed logprobs, in two packing orders, equal `LLM.score`'s bit for bit, and the
    negative control: the same module on the stock backend misses them;
  * the gradient of a weighted logprob loss matches transformers' float32 autograd within
    1e-4 (relative, per tensor), and the control: one token changed moves it past the bound;
  * after an optimizer step, `LLM.update_weights(model.state_dict())` serves the trainer's
    bits, and the control: the engine's bits before the update differ.

The rows cover every family in lockstep/models/families (a test checks that), with the
variants that change the layer loop: windows (Mistral v0.1, Ministral, Gemma 3), fused
checkpoint tensors and LongRoPE (Phi-3), hybrid Gated DeltaNet (Qwen3.5, Qwen3-Next's grouped
projections), MoE (Qwen3-MoE, the hybrid MoE families with a gated shared expert) and MLA
with DeepSeek routing (V2, V3, GLM-4.7-Flash).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.engine.llm import LLM
from lockstep.models.families import FAMILIES, family_of
from lockstep.models.moe import split_fused_experts
from lockstep.models.spec import ModelSpec
from lockstep.training import LockstepForCausalLM
from tests.support.tiny_hf import save_tiny

VOCAB = 300  # tiny_hf's
LENGTHS = [2, 19, 7, 40]  # past the engine's 16-token chunks and the 8-token windows
# (row id, tiny_hf writer, config overrides)
ROWS = (
    ("llama", "llama", {}),
    ("qwen2", "qwen2", {}),
    ("qwen3", "qwen3", {}),
    ("mistral-window", "mistral", {"sliding_window": 8}),
    ("ministral", "ministral", {}),
    ("phi3", "phi3", {}),
    ("gemma3", "gemma3", {}),
    ("qwen3_moe", "qwen3_moe", {}),
    ("qwen3_5", "qwen3_5", {}),
    ("qwen3_5_moe", "qwen3_5_moe", {}),
    ("qwen3_next", "qwen3_next", {}),
    ("deepseek_v2", "deepseek_v2", {}),
    ("deepseek_v3", "deepseek_v3", {}),
    ("glm4_moe_lite", "glm4_moe_lite", {}),
)

# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sequences(seed: int) -> list[list[int]]:
    """Token ids from 1: transformers never trains the embedding row of a padding id (Gemma 3's
    is 0), which the gradient comparison would otherwise count as a mismatch."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in LENGTHS]


def _scores(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """`LLM.score`'s logprobs of tokens 1.. of each sequence, float64 (exact: float32 values)."""
    return [torch.tensor(o.logprobs[1:], dtype=torch.float64)
            for o in llm.score(sequences, use_tqdm=False)]  # fmt: skip


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.double(), y.double()) for x, y in zip(a, b, strict=True))


def _loss(lps: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp * w).sum() for lp, w in zip(lps, weights, strict=True))  # type: ignore[return-value]


def _canonical(
    grads: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """transformers' gradients under the canonical names the trainer's parameters carry: the
    family's own checkpoint mapping (names, rows of fused tensors: Phi-3's qkv_proj) and
    transformers' fused expert tensors split per expert."""
    family = family_of(config, "config.json")
    out: dict[str, torch.Tensor] = {}
    for name, grad in split_fused_experts(grads):
        canonical = family.tensor_name(name)
        if canonical is None:
            continue
        for part, rows in family.parts(canonical, spec):
            out[part] = grad if rows is None else grad[rows]
    return out


def _transformers_grads(
    hf: Any, sequences: list[list[int]], weights: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """transformers' float32 autograd of the same loss, one sequence per forward."""
    hf.zero_grad()
    loss = torch.zeros(())
    for seq, w in zip(sequences, weights, strict=True):
        ids = torch.tensor([seq])
        lps = torch.log_softmax(hf(ids).logits[0].float(), -1)[:-1]
        loss = loss + (lps.gather(1, ids[0, 1:, None])[:, 0] * w).sum()
    loss.backward()
    return [(n, p.grad.clone()) for n, p in hf.named_parameters() if p.grad is not None]


def _worst_relative_error(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """The largest relative error over every tensor transformers gives a nonzero gradient;
    tensors it gives none or zero (experts no token chose) must get none or zero here."""
    params = dict(model.named_parameters())
    worst = 0.0
    for name, ref in reference.items():
        grad = params[name].grad
        if not ref.any():
            assert grad is None or not grad.any(), name
            continue
        assert grad is not None, f"{name}: no gradient"
        worst = max(worst, ((grad - ref).norm() / ref.norm()).item())
    moved = {n for n, p in params.items() if p.grad is not None and p.grad.any()}
    assert moved <= set(reference), sorted(moved - set(reference))[:3]
    return worst


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, tuple[Path, Any]] = {}

    def write(row: tuple[str, str, dict[str, Any]]) -> tuple[Path, Any]:
        name, writer, overrides = row
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, save_tiny(writer, folder, **overrides)
        return cache[name]

    return write


def test_the_rows_cover_every_family_the_engine_serves(written) -> None:
    """A family added to lockstep/models/families without a row here fails this test."""
    served = {f.name for f in FAMILIES}
    covered = set()
    for row in ROWS:
        folder, _ = written(row)
        covered.add(family_of(json.loads((folder / "config.json").read_text()), row[0]).name)
    assert covered == served, sorted(served - covered)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_family_trains_with_the_engine_bits(written, row: tuple[str, str, dict]) -> None:
    folder, hf = written(row)
    sequences = _sequences(seed=7)
    llm = LLM(str(folder), device="cpu", dtype="float32", kv_tokens=2048, max_batch_tokens=64,
              chunk_size=16)  # fmt: skip
    scores = _scores(llm, sequences)
    model = LockstepForCausalLM.from_pretrained(str(folder))
    stock = LockstepForCausalLM.from_pretrained(str(folder), mode="reference")
    with torch.no_grad():
        assert _bitwise_equal(model(sequences[::-1]).per_sequence()[::-1], scores)
        assert not _bitwise_equal(stock(sequences).per_sequence(), scores)  # the control

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=gen) for s in sequences]
    config = json.loads((folder / "config.json").read_text())
    hf.float().train(False)
    reference = _canonical(_transformers_grads(hf, sequences, weights), config, model.spec)
    out = model(sequences)
    assert _bitwise_equal(out.per_sequence(), scores)
    _loss(out.per_sequence(), weights).backward()
    assert _worst_relative_error(model, reference) < 1e-4
    # The control: one token changed in one sequence moves some gradient past the bound.
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    changed = [list(s) for s in sequences]
    changed[1][5] = changed[1][5] % (VOCAB - 1) + 1
    _loss(model(changed).per_sequence(), weights).backward()
    assert _worst_relative_error(model, reference) > 1e-4

    for name, param in model.named_parameters():  # the first loss's step, by hand (SGD)
        if name in grads:
            param.data.add_(grads[name], alpha=-0.5)
    with torch.no_grad():
        trained = model(sequences).per_sequence()
    assert not _bitwise_equal(trained, scores)  # the control: the engine's old weights differ
    llm.update_weights(model.state_dict())
    assert _bitwise_equal(_scores(llm, sequences), trained)


# bfloat16 weights (float32 activations on the CPU, a bfloat16 KV cache): a hybrid, an MLA and
# a windowed, soft-capped row.
@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3", "gemma3"])
def test_bfloat16_packed_logprobs_are_llm_score_bits(written, name: str) -> None:
    (row,) = [r for r in ROWS if r[0] == name]
    folder, _ = written(row)
    sequences = _sequences(seed=9)
    llm = LLM(str(folder), device="cpu", dtype="bfloat16", kv_tokens=2048, max_batch_tokens=64,
              chunk_size=16)  # fmt: skip
    scores = _scores(llm, sequences)
    with torch.no_grad():
        model = LockstepForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
        assert _bitwise_equal(model(sequences).per_sequence(), scores)
        stock = LockstepForCausalLM.from_pretrained(
            str(folder), dtype=torch.bfloat16, mode="reference"
        )
        assert not _bitwise_equal(stock(sequences).per_sequence(), scores)  # the control
