"""The sampler: counter-based draws, filters, and the basic-operation exp/log it relies on."""

from __future__ import annotations

import math
from collections import Counter

import torch

from lockstep.engine.sampler import _exp, _log, _uniform, choose_token, top_logprobs


def _choose(logits: torch.Tensor, **kw) -> int:
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0)
    params.update(kw)
    return choose_token(logits, torch.log_softmax(logits, -1), **params)


def test_exp_and_log_match_libm() -> None:
    x = torch.linspace(-700.0, 0.0, 20001, dtype=torch.float64)
    got, want = _exp(x), torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    # Range reduction with a rounded ln2 costs ~1e-16 per multiple of ln2: 1e-13 at x=-700.
    assert torch.allclose(got, want, rtol=1e-13, atol=0)
    y = torch.logspace(-300, 300, 20001, dtype=torch.float64)
    got, want = _log(y), torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-15, atol=1e-15)


def test_uniforms_are_a_function_of_seed_position_and_index() -> None:
    a = _uniform(7, 100, 1000, torch.device("cpu"))
    assert torch.equal(a, _uniform(7, 100, 1000, torch.device("cpu")))
    assert torch.equal(a[:10], _uniform(7, 100, 10, torch.device("cpu")))  # prefix-stable
    assert not torch.equal(a, _uniform(8, 100, 1000, torch.device("cpu")))
    assert not torch.equal(a, _uniform(7, 101, 1000, torch.device("cpu")))
    assert bool((a > 0).all() and (a < 1).all())
    assert abs(float(a.mean()) - 0.5) < 0.03


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert _choose(logits, temperature=0.0) == 1


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    counts = Counter(_choose(logits, position=p) for p in range(4000))
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)


def test_filters() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, -5.0])
    draws = lambda **kw: {_choose(logits, position=p, **kw) for p in range(300)}  # noqa: E731
    assert draws(top_k=1) == {0}
    assert draws(top_k=2) == {0, 1}
    assert draws(min_p=0.5) == {0, 1}  # tokens 2.. have < half the top probability
    assert draws(top_p=0.3) == {0}
    assert draws(top_p=0.6) == {0, 1}
    assert {0, 1, 2} <= draws()  # unfiltered, the 6% token shows up in 300 draws


def test_top_logprobs_order() -> None:
    lp = torch.tensor([-1.0, -0.5, -0.5, -3.0])
    assert top_logprobs(lp, 3) == ((1, -0.5), (2, -0.5), (0, -1.0))
