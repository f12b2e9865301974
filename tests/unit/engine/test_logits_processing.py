"""Penalties, logit_bias, min_tokens and bad_words (lockstep/engine/logits_processing.py):
the processed rows against the formula computed element by element with numpy float32, each
row independent of its batch-mates, and their effect through the engine (random:tiny).
Each check has a control that shows it can fail."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lockstep.engine.llm import LLM
from lockstep.engine.logits_processing import process_logits
from lockstep.engine.request import Request
from lockstep.engine.sampling_params import SamplingParams

V = 64


def _request(params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request("r", list(prompt), params, seed=0, arrival=0)
    request.output_ids = list(output)
    request.prompt_token_set = sorted(set(prompt))
    request.stop_ids = frozenset({1, 2})
    return request


def _random_request(rng: random.Random) -> Request:
    params = SamplingParams(
        max_tokens=64,
        presence_penalty=rng.choice([0.0, 0.5, -1.25, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7, 1.9]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8, 1.0 + 2**-20]),
        min_tokens=rng.choice([0, 0, 3, 40]),
        logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(V), rng.randint(0, 5))},
    )
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 20))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 30))]
    return _request(params, prompt, output)


def _reference_row(x: np.ndarray, request: Request) -> np.ndarray:
    """vLLM's formulas, one element at a time in numpy float32."""
    p, f32 = request.params, np.float32
    out = x.astype(np.float32).copy()
    counts = np.zeros(V, dtype=np.int64)
    for t in request.output_ids:
        counts[t] += 1
    if len(request.output_ids) < p.min_tokens:
        for t in request.stop_ids:
            out[t] = -np.inf
    for t, b in p.logit_bias:
        out[t] = f32(out[t] + f32(b))
    seen = set(request.prompt_ids) | set(request.output_ids)
    r = f32(p.repetition_penalty)
    for t in range(V):
        if p.repetition_penalty != 1.0 and t in seen:
            out[t] = f32(out[t] / r) if out[t] > 0 else f32(out[t] * r)
        out[t] = f32(out[t] - f32(f32(p.frequency_penalty) * f32(counts[t])))
        out[t] = f32(out[t] - f32(f32(p.presence_penalty) * f32(counts[t] > 0)))
    return out


def _logits(rng: random.Random, rows: int) -> torch.Tensor:
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 8
    x[:, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])  # signs and zeros
    return x


@pytest.mark.parametrize("seed", range(6))
def test_rows_follow_the_formula_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    requests = [_random_request(rng) for _ in range(8)]
    logits = _logits(rng, len(requests))
    got = process_logits(logits, requests)
    for i, request in enumerate(requests):
        want = _reference_row(logits[i].numpy(), request)
        assert np.array_equal(got[i].numpy().view(np.int32), want.view(np.int32)), (i, request)


def test_the_formula_check_sees_one_ulp() -> None:
    """Control: a repetition penalty one float32 ulp away changes processed bits, so the
    bitwise comparison above would see a wrong factor or order."""
    rng = random.Random(0)
    request = _request(SamplingParams(repetition_penalty=1.3), list(range(V)), [])
    other = _request(SamplingParams(repetition_penalty=float(np.nextafter(np.float32(1.3), 2))),
                     list(range(V)), [])  # fmt: skip
    logits = _logits(rng, 1)
    assert not torch.equal(process_logits(logits, [request]), process_logits(logits, [other]))


@pytest.mark.parametrize("seed", range(4))
def test_a_row_is_the_same_alone_and_in_any_batch(seed: int) -> None:
    rng = random.Random(100 + seed)
    plain = _request(SamplingParams(), [1, 2, 3], [4])
    requests = [_random_request(rng) if rng.random() < 0.7 else plain for _ in range(10)]
    logits = _logits(rng, len(requests))
    together = process_logits(logits, requests)
    for i, request in enumerate(requests):
        alone = process_logits(logits[i : i + 1], [request])
        assert torch.equal(together[i].view(torch.int32), alone[0].view(torch.int32))
        if request is plain:
            assert torch.equal(together[i].view(torch.int32), logits[i].view(torch.int32))
    assert not torch.equal(together, logits)  # control: something was processed


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:tiny", device="cpu", dtype="float32", kv_tokens=2048)


def _run(llm: LLM, **kw: object):
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})
    return llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]


def test_logit_bias_min_tokens_and_bad_words_through_the_engine(llm: LLM) -> None:
    eos = llm.engine.tokenizer.eos_token_id
    a = llm.engine.tokenizer.encode("A", add_special_tokens=False)[0]
    assert _run(llm, logit_bias={eos: 100.0}).token_ids == [eos]  # EOS at once
    held = _run(llm, logit_bias={eos: 100.0}, min_tokens=5).token_ids
    assert len(held) == 6 and eos not in held[:5] and held[5] == eos
    biased = _run(llm, logit_bias={a: 100.0}, ignore_eos=True)
    assert biased.token_ids == [a] * 12
    assert _run(llm, ignore_eos=True).token_ids != [a] * 12  # control: the bias did it
    banned = _run(llm, logit_bias={a: 100.0}, bad_words=("A",), ignore_eos=True).token_ids
    assert a not in banned
    # Stop strings wait for min_tokens: "A" stops the 3rd token, not the 1st.
    stopped = _run(llm, logit_bias={a: 100.0}, stop=("A",), min_tokens=3)
    assert stopped.text == "AA" and stopped.finish_reason == "stop"
    assert _run(llm, logit_bias={a: 100.0}, stop=("A",)).text == ""


def test_penalties_change_the_choice_and_logprobs_stay_raw(llm: LLM) -> None:
    plain = _run(llm, max_tokens=24, ignore_eos=True)
    for kw in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
    ):
        penalized = _run(llm, max_tokens=24, ignore_eos=True, logprobs=0, **kw)
        assert penalized.token_ids != plain.token_ids, kw
        assert max(map(penalized.token_ids.count, penalized.token_ids)) <= max(
            map(plain.token_ids.count, plain.token_ids)
        ), kw
        # Reported logprobs are the raw logits' (vLLM's raw_logprobs): scoring agrees.
        scored = llm.score([[5, 6, 7, 8, *penalized.token_ids]], use_tqdm=False)[0]
        assert scored.logprobs[4:] == penalized.logprobs, kw


def test_out_of_vocabulary_bias_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        _run(llm, logit_bias={10**6: 1.0})
