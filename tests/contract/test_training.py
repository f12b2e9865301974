"""The training module (lockstep.training): its logprobs are the engine's bits for packed
batches of any composition and order, its gradients are transformers' (float32, relative
1e-4), and trained weights go back to the engine (in-process and through a saved folder)
with the trainer's bits; the dense families here, every family's row in
tests/contract/test_family_training.py. Tiny random models written by transformers
(tests/support/tiny_hf.py)."""

from __future__ import annotations

import random
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

from lockstep import LLM  # noqa: E402
from lockstep.errors import ModelLoadError  # noqa: E402
from lockstep.training import LockstepForCausalLM  # noqa: E402
from tests.support.tiny_hf import save_tiny  # noqa: E402

VOCAB = 300  # tiny_hf's
LENGTHS = [1, 3, 9, 17, 33, 40]  # across the engine's 16-token chunks and 64-token batches
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FOLDERS = ("llama", "qwen2", "qwen3", "qwen3_5")  # qwen3_5: the hybrid GRPO run


def _sequences(seed: int, lengths: list[int] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _llm(model: str, dtype: str) -> LLM:
    return LLM(model, device="cpu", dtype=dtype, kv_tokens=2048, max_batch_tokens=64,
               chunk_size=16)  # fmt: skip


def _scores(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """`LLM.score`'s logprobs of tokens 1.. of each sequence, float64 (exact: float32 values)."""
    outs = llm.score(sequences, use_tqdm=False)
    return [torch.tensor(o.logprobs[1:], dtype=torch.float64) for o in outs]


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.double(), y.double()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("training")
    for family in FOLDERS:
        save_tiny(family, root / family)
    return {family: root / family for family in FOLDERS}


# llama: Llama 3 RoPE scaling; qwen2: q/k/v biases, tied embeddings; qwen3: q/k norms, GQA.
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_logprobs_are_llm_score_bits(
    folders: dict[str, Path], family: str, dtype: str
) -> None:
    folder = str(folders[family])
    sequences = _sequences(seed=len(family))
    llm = _llm(folder, dtype)
    scores = _scores(llm, sequences)
    model = LockstepForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    rng = random.Random(7)
    order = list(range(len(sequences)))
    rng.shuffle(order)
    # Every sequence alone, all together in two orders, and a subset: each batch's
    # sequences must get the bits LLM.score gave (chunked prefill, other batch-mates).
    compositions = [[i] for i in order] + [order, order[::-1], sorted(order[:3])]
    with torch.no_grad():
        for batch in compositions:
            out = model([sequences[i] for i in batch])
            assert _bitwise_equal(out.per_sequence(), [scores[i] for i in batch]), batch
        # Logits on request: the engine decoder's own cold prefill, row for row.
        out = model([sequences[i] for i in order], return_logits=True)
        decoder = llm.engine.decoder
        cu = out.cu_seqlens
        assert out.logits is not None
        for b, i in enumerate(order):
            expected = decoder.logits_for_sequence(sequences[i])
            assert torch.equal(out.logits[cu[b] : cu[b + 1]], expected)
        # The control: the same module on the stock backend (torch GEMM and SDPA) is close
        # but not bit-identical, so the equalities above could fail.
        stock = LockstepForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], mode="reference")
        stock_out = stock([sequences[i] for i in order], return_logits=True)
    stock_lps = stock_out.per_sequence()
    expected_lps = [scores[i] for i in order]
    assert not _bitwise_equal(stock_lps, expected_lps)
    assert stock_out.logits is not None and not torch.equal(stock_out.logits, out.logits)
    pairs = [(a, b) for a, b in zip(stock_lps, expected_lps, strict=True) if b.numel()]
    worst = max((a.double() - b).abs().max().item() for a, b in pairs)
    assert worst < (1e-3 if dtype == "float32" else 0.1)


def test_chunked_reduction_gives_the_bits_of_a_tensor_parallel_engine(
    folders: dict[str, Path],
) -> None:
    """tp_reduction="chunked" (the default at TP > 1, the same bits at every degree)."""
    folder = str(folders["qwen3"])
    sequences = _sequences(seed=13, lengths=[4, 21, 35])
    llm = LLM(folder, device="cpu", dtype="float32", kv_tokens=2048, max_batch_tokens=64,
              chunk_size=16, tp_reduction="chunked")  # fmt: skip
    scores = _scores(llm, sequences)
    with torch.no_grad():
        chunked = LockstepForCausalLM.from_pretrained(folder, tp_reduction="chunked")
        assert _bitwise_equal(chunked(sequences).per_sequence(), scores)
        # The control: the one-call linear (the TP 1 default) adds in another order.
        ranks = LockstepForCausalLM.from_pretrained(folder)
        assert not _bitwise_equal(ranks(sequences).per_sequence(), scores)


def _weighted_loss(lps: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp * w).sum() for lp, w in zip(lps, weights, strict=True))  # type: ignore[return-value]


def _transformers_grads(
    folder: Path, sequences: list[list[int]], weights: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """transformers' float32 autograd of the same loss, one sequence per forward."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loss = torch.zeros(())
    for seq, w in zip(sequences, weights, strict=True):
        ids = torch.tensor([seq])
        lps = torch.log_softmax(hf(ids).logits[0].float(), -1)[:-1]
        loss = loss + (lps.gather(1, ids[0, 1:, None])[:, 0] * w).sum()
    loss.backward()
    return {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


def _worst_relative_error(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """The largest relative error over `reference`'s tensors (every parameter with a gradient
    is among them)."""
    grads = dict(model.named_parameters())
    assert {n for n, p in grads.items() if p.grad is not None and p.grad.any()} <= set(reference)
    return max(((grads[n].grad - ref).norm() / ref.norm()).item() for n, ref in reference.items())


@pytest.mark.parametrize(
    "family, checkpointing", [("llama", True), ("qwen2", False), ("qwen3", False)]
)
def test_gradients_are_transformers_autograd(
    folders: dict[str, Path], family: str, checkpointing: bool
) -> None:
    sequences = _sequences(seed=11, lengths=[2, 7, 20, 13])
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=gen) for s in sequences]
    reference = _transformers_grads(folders[family], sequences, weights)
    model = LockstepForCausalLM.from_pretrained(
        str(folders[family]), gradient_checkpointing=checkpointing
    )
    _weighted_loss(model(sequences[::-1]).per_sequence()[::-1], weights).backward()
    assert _worst_relative_error(model, reference) < 1e-4
    # The control: one token changed in one sequence moves some gradient past the bound.
    model.zero_grad()
    changed = [list(s) for s in sequences]
    changed[2][5] = (changed[2][5] + 1) % VOCAB
    _weighted_loss(model(changed).per_sequence(), weights).backward()
    assert _worst_relative_error(model, reference) > 1e-4


# qwen2: tied embeddings (the head's gradient adds to the embedding's); qwen3_5: the hybrid.
@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_the_head_in_chunks_of_rows_gives_the_whole_heads_bits_and_gradients(
    folders: dict[str, Path], family: str
) -> None:
    """The default forward runs the LM head and log-softmax a chunk of rows at a time
    (lockstep/training/token_logprobs.py); with chunks of 5 rows (several per sequence) its
    logprobs are those of the whole [T, vocab] logits (`return_logits=True`) bit for bit, and
    its gradients theirs within 1e-5: its backward is a closed form of its own (vocabulary
    chunks, torch matmuls), so the two agree to float32 rounding, which on an ill-conditioned
    tensor (a k_proj bias, whose gradient softmax's shift invariance makes small) reaches
    1e-6 for either path against float64 autograd (the exact formula is
    tests/unit/training/test_head_backward.py's)."""
    sequences = _sequences(seed=19, lengths=[3, 12, 7])
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(len(s) - 1, generator=gen) for s in sequences]
    model = LockstepForCausalLM.from_pretrained(str(folders[family]))
    whole = model(sequences, return_logits=True)
    _weighted_loss(whole.per_sequence(), weights).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.logprob_chunk_rows = 5
    chunked = model(sequences)
    assert chunked.logits is None
    assert torch.equal(chunked.logprobs, whole.logprobs)
    _weighted_loss(chunked.per_sequence(), weights).backward()
    assert _worst_relative_error(model, reference) < 1e-5
    # The control: a sequence with one token changed gives other logprobs and gradients.
    model.zero_grad()
    changed = [list(s) for s in sequences]
    changed[1][4] = (changed[1][4] + 1) % VOCAB
    out = model(changed)
    assert not torch.equal(out.logprobs, whole.logprobs)
    _weighted_loss(out.per_sequence(), weights).backward()
    assert _worst_relative_error(model, reference) > 1e-5


def test_the_backward_keeps_no_tensor_of_every_rows_logits(folders: dict[str, Path]) -> None:
    """What autograd saves for the backward: with the head in chunks, no tensor of logits or
    log-probabilities at all (the control: `return_logits=True` keeps the whole [T, vocab]
    log-softmax)."""
    sequences = _sequences(seed=23, lengths=[30, 40, 25])
    model = LockstepForCausalLM.from_pretrained(str(folders["qwen3"]))
    model.logprob_chunk_rows = 16

    def vocab_rows_saved(return_logits: bool) -> int:
        """The most rows of any saved tensor [rows, vocab]."""
        rows = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 2 and t.shape[1] == VOCAB:
                rows.append(t.shape[0])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(sequences, return_logits=return_logits)
        return max(rows)

    assert vocab_rows_saved(return_logits=False) == 0
    assert vocab_rows_saved(return_logits=True) == sum(map(len, sequences))


# qwen2 from a folder (tied embeddings: config and tokenizer copied); llama and Qwen3.5 (hybrid)
# from a random preset (config.json written from the spec, tokenizer files from Lockstep's).
@pytest.mark.parametrize(
    "source, dtype",
    [("qwen2", "bfloat16"), ("random:tiny", "float32"), ("random:tiny-qwen3.5", "float32")],
)
def test_trained_weights_serve_with_the_trainer_bits(
    folders: dict[str, Path], tmp_path: Path, source: str, dtype: str
) -> None:
    model_arg = source if source.startswith("random:") else str(folders[source])
    sequences = _sequences(seed=3, lengths=[5, 12, 30])
    model = LockstepForCausalLM.from_pretrained(model_arg, dtype=DTYPES[dtype])
    llm = _llm(model_arg, dtype)
    before = _scores(llm, sequences)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        out = model(sequences)
        loss = -out.logprobs.sum() / out.mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # the weights changed, and in the loss's direction
    with torch.no_grad():
        trained = model(sequences, return_logits=True)
    trained_lps = trained.per_sequence()
    assert not _bitwise_equal(before, trained_lps)  # the control: the old weights differ
    llm.update_weights(model.state_dict())
    assert _bitwise_equal(_scores(llm, sequences), trained_lps)
    folder = tmp_path / "trained"
    model.save_pretrained(folder)
    assert _bitwise_equal(_scores(_llm(str(folder), dtype), sequences), trained_lps)
    # What the server's /update_weights_from_disk runs: an engine on the old weights reloads.
    on_old = _llm(model_arg, dtype)
    on_old.update_weights(str(folder))
    assert _bitwise_equal(_scores(on_old, sequences), trained_lps)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert trained.logits is not None
    cu = trained.cu_seqlens
    for b, seq in enumerate(sequences):
        with torch.no_grad():
            hf_logits = hf(torch.tensor([seq])).logits[0].float()
        # bfloat16: the engine's K/V cache rounds to bfloat16, transformers' float32 does not.
        tolerance = 1e-3 if dtype == "float32" else 5e-2
        torch.testing.assert_close(
            hf_logits, trained.logits[cu[b] : cu[b + 1]], atol=tolerance, rtol=0
        )


def test_gradient_checkpointing_of_a_hybrid_model(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3.5's Gated DeltaNet layers advance their sequences' states in place; a recomputed
    layer starts again from the cold state: the same logprobs, gradients within 1e-6. The
    control: without that reset the recomputation would continue from the advanced state,
    which the delta rule's backward refuses (it differentiates from a cold start)."""
    from lockstep.training import model as model_module

    folder = str(folders["qwen3_5"])
    sequences = _sequences(seed=29, lengths=[5, 70, 18])  # 70: past a 64-row chunk
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(len(s) - 1, generator=gen) for s in sequences]
    plain = LockstepForCausalLM.from_pretrained(folder)
    out = plain(sequences)
    _weighted_loss(out.per_sequence(), weights).backward()
    reference = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    checkpointed = LockstepForCausalLM.from_pretrained(folder, gradient_checkpointing=True)
    got = checkpointed(sequences)
    assert torch.equal(got.logprobs, out.logprobs)
    _weighted_loss(got.per_sequence(), weights).backward()
    assert _worst_relative_error(checkpointed, reference) < 1e-6
    monkeypatch.setattr(model_module, "_cold_layer_state", lambda layer, step: nullcontext())
    loss = _weighted_loss(checkpointed(sequences).per_sequence(), weights)
    with pytest.raises(ValueError, match="starts at position 0"):
        loss.backward()


def test_fp8_checkpoints_are_refused_in_one_line(tmp_path: Path) -> None:
    from tests.support.tiny_fp8 import write_fp8_folder

    write_fp8_folder(tmp_path / "fp8", "fp8-block")
    with pytest.raises(ModelLoadError, match="FP8 checkpoints cannot be trained"):
        LockstepForCausalLM.from_pretrained(str(tmp_path / "fp8"))


# qwen3_5: a hybrid (Gated DeltaNet) model, its sampler's decode steps against the trainer's
# packed prefill.
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_grpo_example_has_zero_k3_and_unit_ratios(folders: dict[str, Path], family: str) -> None:
    from lockstep.training.grpo import run

    folder = str(folders[family])

    def mean_code_point(text: str) -> float:  # varies across a random byte model's samples
        return sum(map(ord, text)) / max(len(text), 1)

    one_prompt = ("The weather today is",)
    reports, trainer, _ = run(
        folder, 5, group_size=2, prompts=one_prompt, max_tokens=6, lr=1e-3, reward=mean_code_point
    )
    assert len(reports) == 5
    for r in reports:
        assert (r.k3_max, r.ratio_min, r.ratio_max) == (0.0, 1.0, 1.0), r
    # The weights change, and with them the policy: the sampled tokens' logprobs move.
    start = LockstepForCausalLM.from_pretrained(folder)
    probe = _sequences(seed=5, lengths=[6, 9])
    with torch.no_grad():
        assert not torch.equal(trainer(probe).logprobs, start(probe).logprobs)
    # The control: recomputed on the stock backend, the training policy is off by some bits.
    (stock,), _, _ = run(folder, 1, group_size=2, prompts=one_prompt, max_tokens=6,
                        reward=mean_code_point, trainer_mode="reference")  # fmt: skip
    assert stock.k3_max > 0.0 and (stock.ratio_min, stock.ratio_max) != (1.0, 1.0)


def _readme_trainer_block() -> str:
    """The README's Python block that loads `LockstepForCausalLM` (the trainer's lines)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    blocks = readme.split("```python\n")[1:]
    (block,) = [b.split("```")[0] for b in blocks if "LockstepForCausalLM" in b]
    return block


def test_readme_trainer_lines_run_and_serve_the_trainer_bits(folders: dict[str, Path]) -> None:
    """The README's lines, run as written (with the names its text defines): afterwards the
    engine scores with the trained policy's bits; the control, an engine on the weights the
    policy started from, differs. docs/training.md shows the same lines."""
    block = _readme_trainer_block()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text("utf-8")
    code_lines = [line.split("  #")[0] for line in block.splitlines()]
    assert all(line in docs for line in code_lines)
    assert sum(1 for line in code_lines if line and not line.startswith("llm =")) == 5
    folder = str(folders["qwen3"])
    sequences = _sequences(seed=21, lengths=[4, 11])
    gen = torch.Generator().manual_seed(1)
    names = {
        "LLM": lambda path: _llm(path, "float32"),
        "LockstepForCausalLM": LockstepForCausalLM,
        "path": folder,
        "token_id_lists": sequences,
        "advantages": torch.randn(sum(map(len, sequences)), generator=gen),
    }

    class FirstStepMakesTheOptimizer:  # `optimizer` over the policy the block creates
        def step(self) -> None:
            torch.optim.SGD(names["policy"].parameters(), lr=0.5).step()

    names["optimizer"] = FirstStepMakesTheOptimizer()
    exec(block, names)  # noqa: S102
    with torch.no_grad():
        trained = names["policy"](sequences).per_sequence()
    assert _bitwise_equal(_scores(names["llm"], sequences), trained)
    assert not _bitwise_equal(_scores(_llm(folder, "float32"), sequences), trained)


def test_a_module_moved_after_loading_is_refused() -> None:
    model = LockstepForCausalLM.from_pretrained("random:tiny-qwen3").to(torch.bfloat16)
    with pytest.raises(ValueError, match="pass device and dtype to from_pretrained"):
        model([[1, 2, 3]])


def test_a_flat_tensor_with_lengths_is_the_same_batch() -> None:
    model = LockstepForCausalLM.from_pretrained("random:tiny-qwen3")
    sequences = _sequences(seed=17, lengths=[3, 8, 5])
    flat = torch.tensor([t for s in sequences for t in s])
    with torch.no_grad():
        as_lists = model(sequences).logprobs
        assert torch.equal(model(flat, seq_lens=[3, 8, 5]).logprobs, as_lists)
        # The control: the same ids cut elsewhere are other sequences.
        assert not torch.equal(model(flat, seq_lens=[4, 7, 5]).logprobs, as_lists)
        with pytest.raises(ValueError, match="add up to the number of ids"):
            model(flat, seq_lens=[3, 8])
