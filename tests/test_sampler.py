"""The sampler: counter-based draws, filters, and the basic-operation exp/log it relies on."""

from __future__ import annotations

import math
from collections import Counter

import torch

from lockstep.engine.sampler import (
    RowSampling,
    _exp,
    _log,
    _uniform,
    choose_token_tensor,
    top_logprobs,
)


def choose_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> list[int]:
    return choose_token_tensor(logits, rows).tolist()


def _row(**kw) -> RowSampling:
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0)
    params.update(kw)
    return RowSampling(**params)


def _choose(logits: torch.Tensor, **kw) -> int:
    return choose_tokens(logits[None, :], [_row(**kw)])[0]


def _u(seed: int, position: int, n: int) -> torch.Tensor:
    return _uniform(torch.tensor([seed]), torch.tensor([position]), n)[0]


def test_exp_and_log_match_libm() -> None:
    x = torch.linspace(-700.0, 0.0, 20001, dtype=torch.float64)
    got, want = _exp(x), torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    # Range reduction with a rounded ln2 costs ~1e-16 per multiple of ln2: 1e-13 at x=-700.
    assert torch.allclose(got, want, rtol=1e-13, atol=0)
    y = torch.logspace(-300, 300, 20001, dtype=torch.float64)
    got, want = _log(y), torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-15, atol=1e-15)


def test_uniforms_are_a_function_of_seed_position_and_index() -> None:
    a = _u(7, 100, 1000)
    assert torch.equal(a, _u(7, 100, 1000))
    assert torch.equal(a[:10], _u(7, 100, 10))  # prefix-stable
    assert not torch.equal(a, _u(8, 100, 1000))
    assert not torch.equal(a, _u(7, 101, 1000))
    big = _u(2**62 + 12345, 2**40, 1000)  # 64-bit seeds and large positions
    assert bool((big > 0).all() and (big < 1).all())
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


def test_a_rows_token_does_not_depend_on_the_other_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 500, generator=gen) * 3
    rows = [
        _row(temperature=t, top_k=k, top_p=p, min_p=m, seed=i * 7, position=100 + i)
        for i, (t, k, p, m) in enumerate(
            [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
             (1.0, 0, 1.0, 0.05), (0.5, 5, 0.8, 0.01)] * 2
        )
    ]  # fmt: skip
    together = choose_tokens(logits, rows)
    alone = [choose_tokens(logits[i : i + 1], [rows[i]])[0] for i in range(12)]
    assert together == alone
    reversed_order = choose_tokens(logits.flip(0), rows[::-1])[::-1]
    assert reversed_order == together
    # The control: moving every sampled row to another position changes some tokens.
    shifted = [RowSampling(**{**r.__dict__, "position": r.position + 1}) for r in rows]
    assert choose_tokens(logits, shifted) != together
