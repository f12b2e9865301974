"""The pooled gated delta rule kernel alone (GPU): split invariance at Qwen3.5-9B's head
sizes (one prefill, one-row steps, random splits: outputs and boundary states bitwise), error
against the recurrence in float64, and time per call at prefill and decode shapes.

    python scripts/gdn_kernel_bench.py
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lockstep.ops.base import PooledRows  # noqa: E402
from lockstep.ops.triton import gated_delta  # noqa: E402

HK, HV, DK, DV, C = 16, 32, 128, 128, 32  # Qwen3.5-9B's linear layers


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1)
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 0.5
    beta = torch.rand(n, HV, generator=gen)
    return [t.cuda().contiguous() for t in (q, k, v, g, beta)]


def fresh(slots: int = 1) -> list[torch.Tensor]:
    shapes = ((HV, DK, DV), (C, HK, DK), (C, HV), (C, HV, DV))
    return [torch.zeros((slots, *s), device="cuda") for s in shapes]


def run_split(x: list[torch.Tensor], split: list[int]) -> tuple[torch.Tensor, dict]:
    pool, outs, bounds, start = fresh(), [], {}, 0
    for n in split:
        part = [t[start : start + n].contiguous() for t in x]
        seqs = PooledRows.build([n], [start], [0], C, x[0].device)
        out, b = gated_delta.gated_delta_rule_pooled(*part, *pool, seqs)
        outs.append(out)
        bounds.update({p: b[i].clone() for i, (_, p) in enumerate(seqs.boundaries)})
        start += n
        if start % C == 0:
            bounds[start] = pool[0][0].clone()
    return torch.cat(outs), bounds


def reference(x: list[torch.Tensor]) -> torch.Tensor:
    """The recurrence in float64, row by row."""
    q, k, v, g, beta = (t.double().cpu() for t in x)
    s = torch.zeros(HV, DK, DV, dtype=torch.float64)
    group = HV // HK
    outs = []
    for t in range(q.shape[0]):
        kt, qt = k[t].repeat_interleave(group, 0), q[t].repeat_interleave(group, 0)
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", kt, s))
        s = s + kt[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", qt, s))
    return torch.stack(outs)


def check(n: int = 200) -> str:
    x = inputs(n, 0)
    one, b_one = run_split(x, [n])
    rows, b_rows = run_split(x, [1] * n)
    rng = random.Random(0)
    split, left = [], n
    while left:
        split.append(min(left, rng.randint(1, 70)))
        left -= split[-1]
    rnd, b_rnd = run_split(x, split)
    same = torch.equal(one, rows) and torch.equal(one, rnd)
    same_b = all(torch.equal(b_one[p], b_rows[p]) and torch.equal(b_one[p], b_rnd[p])
                 for p in b_one)  # fmt: skip
    err = ((one.double().cpu() - reference(x)).abs().max() / reference(x).abs().max()).item()
    return f"outputs equal {same}, boundaries equal {same_b} ({len(b_one)}), rel err {err:.2e}"


def time_call(b: int, n: int, start: int) -> float:
    x = inputs(b * n, 1)
    pool = fresh(b)
    seqs = PooledRows.build([n] * b, [start] * b, list(range(b)), C, x[0].device)
    for _ in range(3):
        gated_delta.gated_delta_rule_pooled(*x, *pool, seqs)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        gated_delta.gated_delta_rule_pooled(*x, *pool, seqs)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 10 * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print(f"{'64x128 us':>10s} {'4x2048 us':>10s} {'64x1 us':>8s} {'64x1@31 us':>10s}  invariance")
    times = [time_call(64, 128, 0), time_call(4, 2048, 0), time_call(64, 1, 5),
             time_call(64, 1, 31)]  # fmt: skip
    print(f"{times[0]:10.1f} {times[1]:10.1f} {times[2]:8.1f} {times[3]:10.1f}  {check()}")


if __name__ == "__main__":
    main()
