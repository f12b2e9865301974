"""The sampler: counter-based draws, filters, and the basic-operation exp/log it relies on."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lockstep.engine import sampler
from lockstep.engine.sampler import (
    RowSampling,
    _exp,
    _log,
    _uniform,
    choose_token_tensor,
    gumbel_noise_reference,
    probability_units_reference,
    top_logprobs,
)

GPU = torch.cuda.is_available()


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
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    scores = logits[sampled].double()
    masks = sampler._filter_mask(scores, [rows[i] for i in sampled])
    for j, i in enumerate(sampled):
        assert torch.equal(masks[j], sampler._filter_mask(scores[j : j + 1], [rows[i]])[0]), i
    reversed_order = choose_tokens(logits.flip(0), rows[::-1])[::-1]
    assert reversed_order == together
    # The control: moving every sampled row to another position changes some tokens.
    shifted = [RowSampling(**{**r.__dict__, "position": r.position + 1}) for r in rows]
    assert choose_tokens(logits, shifted) != together


def _noise_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Seeds and positions over the int64 range: negative, 64-bit, large positions."""
    seeds = torch.tensor([0, 7, 2**62 + 12345, -5, 123456789012, -(2**63)], dtype=torch.int64)
    positions = torch.tensor([0, 100, 2**40, 3, 99999, 2**31 - 1], dtype=torch.int64)
    return seeds, positions


def test_cpu_noise_kernel_equals_the_reference_bit_for_bit() -> None:
    """The C++ kernel gives every element of the torch reference's noise. The control: the
    same formula with torch's own log differs from the reference in the last bits of some
    elements, so the comparison sees a last-bit change."""
    from lockstep.ops.cpu_build import load_extension

    seeds, positions = _noise_inputs()
    want = gumbel_noise_reference(seeds, positions, 20000)
    assert torch.equal(load_extension().gumbel_noise(seeds, positions, 20000), want)
    u = _uniform(seeds, positions, 20000)
    assert not torch.equal(-torch.log(-torch.log(u)), want)


def test_triton_noise_kernel_equals_the_reference_bit_for_bit() -> None:
    """The Triton kernel (on the GPU, or the interpreter without one) gives every element of
    the reference's noise (the control is the test above)."""
    from lockstep.ops.triton.sampling import gumbel_noise as triton_noise

    seeds, positions = _noise_inputs()
    want = gumbel_noise_reference(seeds, positions, 20000)
    dev = "cuda" if GPU else "cpu"
    got = triton_noise(seeds.to(dev), positions.to(dev), 20000).cpu()
    assert torch.equal(got, want)


def test_sampling_draws_from_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CPU kernels loaded, sampling never calls the references, and picks the tokens
    the references give (computed first, with the references patched in)."""
    from lockstep.ops.cpu_build import load_extension

    load_extension()
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 2
    rows = [_row(seed=i, position=50 + i, top_p=0.9 if i % 2 else 1.0) for i in range(4)]
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "gumbel_noise", sampler.gumbel_noise_reference)
        patch.setattr(sampler, "probability_units", sampler.probability_units_reference)
        want = choose_tokens(logits, rows)

    def refuse(*args):
        raise AssertionError("a reference was used")

    monkeypatch.setattr(sampler, "gumbel_noise_reference", refuse)
    monkeypatch.setattr(sampler, "probability_units_reference", refuse)
    assert choose_tokens(logits, rows) == want


def test_tiny_temperatures_are_refused() -> None:
    """Temperatures in (0, MIN_TEMPERATURE) are refused (greedy in all but name, and far
    enough down the tempered logits overflow), up to the last float below the limit, while 0
    (greedy) and the limit itself pass."""
    from lockstep.engine.sampling_params import MIN_TEMPERATURE, SamplingParams
    from lockstep.errors import RequestError

    for tiny in (1e-320, 1e-6, math.nextafter(MIN_TEMPERATURE, 0.0)):
        with pytest.raises(RequestError, match="temperature"):
            SamplingParams(temperature=tiny)
    SamplingParams(temperature=0.0)
    SamplingParams(temperature=MIN_TEMPERATURE)


def test_top_p_keeps_the_shortest_prefix_that_reaches_the_mass() -> None:
    """For random rows and thresholds, the kept tokens are the most likely ones (ties by
    lower id) and the shortest such prefix whose probability reaches top_p of the total
    (checked in float64 away from the boundary, where the fixed-point sums cannot matter)."""
    gen = torch.Generator().manual_seed(9)
    for trial in range(40):
        v = 50 + trial
        scores = (torch.randn(1, v, generator=gen) * 2).double()
        p = 0.05 + 0.9 * float(torch.rand(1, generator=gen))
        keep = sampler._filter_mask(scores, [_row(top_p=p)])[0]
        probs = (scores[0] - scores[0].max()).exp()
        order = torch.sort(scores[0], descending=True, stable=True).indices
        mass = torch.cumsum(probs[order], 0) / probs.sum()
        n = int(keep.sum())
        if abs(float(mass[n - 1]) - p) < 1e-9 or (n > 1 and abs(float(mass[n - 2]) - p) < 1e-9):
            continue  # at the boundary: the fixed-point rounding decides
        assert torch.equal(keep.nonzero().flatten().sort().values, order[:n].sort().values)
        assert float(mass[n - 1]) >= p and (n == 1 or float(mass[n - 2]) < p), (trial, n, p)


def _unit_inputs() -> torch.Tensor:
    """Scores minus the best: 0 and -0, -inf, far below the clamp, halfway cases of the
    rounding to multiples of ln 2, and a dense sweep."""
    ln2 = math.log(2.0)
    special = [0.0, -0.0, -math.inf, math.nan, -1e308, -64.0, -63.9, -30.5, -30.49]
    halves = [-(n + 0.5) * ln2 for n in range(92)]
    sweep = torch.linspace(-70.0, 0.0, 30001, dtype=torch.float64)
    return torch.cat([torch.tensor(special + halves, dtype=torch.float64), sweep])


def _full_precision_cases() -> list[tuple[torch.Tensor, int]]:
    """(x, unit_bits) with x in [-(k + 1) ln 2, -k ln 2] and unit_bits = 62 + k: the units then
    hold every bit of exp(x) (53 significant bits, all above the truncation), so they compare
    the kernels' float64 exp itself, not only its first 44 bits."""
    ln2 = math.log(2.0)
    return [(torch.linspace(-(k + 1) * ln2, -k * ln2, 4001, dtype=torch.float64), 62 + k)
            for k in range(0, 37, 3)]  # fmt: skip


def test_cpu_units_kernel_equals_the_reference_bit_for_bit() -> None:
    """Top-p's fixed-point probabilities from the C++ kernel equal the reference's, at the
    sampler's 44 bits and at full precision; the control: torch's own exp gives other bits."""
    from lockstep.ops.cpu_build import load_extension

    ext = load_extension()
    x = _unit_inputs()
    assert torch.equal(ext.probability_units(x, 44), probability_units_reference(x))
    for x, bits in _full_precision_cases():
        assert torch.equal(ext.probability_units(x, bits), probability_units_reference(x, bits))
    x, bits = _full_precision_cases()[0]
    assert not torch.equal((x.exp() * 2.0**bits).to(torch.int64),
                           probability_units_reference(x, bits))  # fmt: skip


def test_triton_units_kernel_equals_the_reference_bit_for_bit() -> None:
    from lockstep.ops.triton.sampling import probability_units as triton_units

    dev = "cuda" if GPU else "cpu"
    x = _unit_inputs()
    assert torch.equal(triton_units(x.to(dev), 44).cpu(), probability_units_reference(x))
    for x, bits in _full_precision_cases():
        got = triton_units(x.to(dev), bits).cpu()
        assert torch.equal(got, probability_units_reference(x, bits)), bits


@pytest.mark.skipif(not GPU, reason="the interpreter does not contract a * b + c")
def test_negative_control_contraction_changes_the_noise() -> None:
    """Why the kernels compile with contraction off: the same noise kernel with a * b + c
    fused differs from the reference in some elements."""
    import triton

    from lockstep.ops.triton import sampling

    seeds, positions = (t.cuda() for t in _noise_inputs())
    n = 20000
    out = torch.empty((seeds.shape[0], n), dtype=torch.float64, device="cuda")
    sampling._gumbel_kernel[(seeds.shape[0], triton.cdiv(n, sampling.BLOCK))](
        seeds, positions, sampling.float64_constants(seeds.device), out, n,
        TERMS=sampling.LOG_TERMS, BLOCK=sampling.BLOCK, PDL=False, enable_fp_fusion=True,
    )  # fmt: skip
    want = gumbel_noise_reference(seeds.cpu(), positions.cpu(), n)
    assert torch.equal(sampling.gumbel_noise(seeds, positions, n).cpu(), want)
    assert not torch.equal(out.cpu(), want)


def test_top_k_keeps_the_first_k_of_a_stable_descending_sort() -> None:
    """Rows with many ties (integer scores): the kept tokens are the first k of a stable
    descending sort (ties by lower id), for several k in one batch."""
    gen = torch.Generator().manual_seed(21)
    scores = torch.randint(-3, 4, (12, 40), generator=gen).double()
    ks = [1, 2, 3, 5, 7, 8, 13, 20, 39, 4, 6, 11]
    keep = sampler._filter_mask(scores, [_row(top_k=k) for k in ks])
    for i, k in enumerate(ks):
        order = torch.sort(scores[i], descending=True, stable=True).indices
        want = torch.zeros(40, dtype=torch.bool)
        want[order[:k]] = True
        assert torch.equal(keep[i], want), (i, k)


def _top_p_by_stable_sort(scores: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Top-p built the plain way, one row at a time: a stable descending sort and the
    shortest prefix whose units reach ceil(top_p * total) (after top-k and min-p)."""
    keep = sampler._filter_mask(scores, [RowSampling(**{**r.__dict__, "top_p": 1.0})
                                         for r in rows])  # fmt: skip
    for i, r in enumerate(rows):
        masked = torch.where(keep[i], scores[i], -math.inf)
        order = torch.sort(masked, descending=True, stable=True).indices
        units = probability_units_reference(masked[order] - scores[i].max())
        cumulative = torch.cumsum(units, 0)
        target = math.ceil(float(cumulative[-1]) * r.top_p)
        n = int((cumulative < target).sum()) + 1
        kept = torch.zeros_like(keep[i])
        kept[order[:n]] = True
        keep[i] &= kept
    return keep


def test_top_p_is_the_plain_stable_sort_construction() -> None:
    """Rows full of ties, with top-k and min-p before top-p, several thresholds in one batch:
    the masks equal the plain one-row-at-a-time stable-sort construction (the sampler sorts
    values only and breaks ties by id afterwards)."""
    gen = torch.Generator().manual_seed(31)
    scores = torch.randint(-40, 3, (8, 300), generator=gen).double() * 0.5
    rows = [_row(top_p=p, top_k=k, min_p=m) for p, k, m in
            [(0.05, 0, 0.0), (0.5, 0, 0.0), (0.9, 0, 0.0), (0.99, 0, 0.0), (0.7, 30, 0.0),
             (0.8, 0, 0.01), (0.95, 5, 0.0), (0.3, 0, 0.0)]]  # fmt: skip
    assert torch.equal(sampler._filter_mask(scores, rows), _top_p_by_stable_sort(scores, rows))
    # At the boundary: the first of two equal tokens holds exactly half of the mass, which
    # reaches top_p = 0.5, so it alone is kept (the lower id).
    tie = torch.tensor([[1.0, 1.0, -math.inf]], dtype=torch.float64)
    assert sampler._filter_mask(tie, [_row(top_p=0.5)]).tolist() == [[True, False, False]]


def test_cpu_top_p_cutoff_by_selection_equals_the_sort() -> None:
    """The C++ kernel finds top-p's count and kept value by a weighted selection; on rows with
    ties, dropped (-inf) tokens, peaked and flat scores and thresholds from 0.0005 to 0.9995
    it gives the sort's exact answer. The control: the next threshold up moves some cutoff."""
    from lockstep.ops.cpu_build import load_extension

    ext = load_extension()
    gen = torch.Generator().manual_seed(41)
    moved = 0
    for trial in range(200):
        rows, v = int(torch.randint(1, 6, (1,), generator=gen)), 2 + trial * 3
        if trial % 3:
            scores = torch.randint(-30, 5, (rows, v), generator=gen).double() * (trial % 7) / 4
        else:
            scores = torch.randn(rows, v, generator=gen, dtype=torch.float64) * (trial % 11)
        best = scores.max(dim=1, keepdim=True).values
        masked = torch.where((torch.rand(rows, v, generator=gen) > 0.3) | (scores == best),
                             scores, -math.inf)  # fmt: skip
        top_p = torch.rand(rows, generator=gen, dtype=torch.float64) * 0.999 + 0.0005
        want = sampler._top_p_cutoff_by_sort(masked, best, top_p[:, None])
        got = ext.top_p_cutoff(masked, best, top_p, sampler.UNIT_BITS)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial
        higher = ext.top_p_cutoff(
            masked, best, torch.clamp(top_p + 0.05, max=0.9999), sampler.UNIT_BITS
        )
        moved += not torch.equal(higher[0], want[0])
    assert moved > 50
    # The larger values' units reach the target exactly (two ties at 0 hold 2**45 units and
    # the target is 2**45): the kept value is 0, not the -1 the selection pivots on first.
    scores = torch.tensor([[0.0, -1.0, 0.0]], dtype=torch.float64)
    best = torch.zeros((1, 1), dtype=torch.float64)
    total = 2 * 2**44 + int(probability_units_reference(torch.tensor([-1.0]).double())[0])
    top_p = torch.tensor([(2**45 - 0.5) / total], dtype=torch.float64)
    want = sampler._top_p_cutoff_by_sort(scores, best, top_p[:, None])
    assert want[0].tolist() == [[2]] and want[1].tolist() == [[0.0]]
    got = ext.top_p_cutoff(scores, best, top_p, sampler.UNIT_BITS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
