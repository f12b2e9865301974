"""The chunked gated delta rule's kernels (lockstep/ops/triton/chunked_delta.py) against the
recurrent one (gated_delta.py), alone on the GPU at Qwen3.5-9B's head sizes: time per pooled
call at prefill shapes (4 x 2048 and 64 x 128 rows, as rows/s) and decode shapes (64 sequences
x 1 row at chunk rows 5 and 31), and the chunked kernels' split invariance (one prefill, one-row
steps, a random split: outputs and boundary states bitwise) with their error against the
recurrence in float64. A table, then one JSON line. `--profile` instead prints each kernel's
GPU time per call at every shape (torch.profiler), for both kernels; `--variants` times the
chunked kernels and checks their split invariance under each launch setting of VARIANTS.

    python scripts/gdn_chunked_bench.py [--profile | --variants]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gdn_kernel_bench import DK, DV, HK, HV, C, inputs  # noqa: E402  (scripts/: sys.path[0])

from lockstep.ops.base import PooledRows  # noqa: E402
from lockstep.ops.triton import chunked_delta, gated_delta  # noqa: E402

# Launch settings of the chunked kernels to compare (module constants of chunked_delta.py):
# dot precision, value columns a state program, its warps and stages, the WY kernel's warps.
VARIANTS = [
    ("tf32x3", 32, 4, 3, 4),
    ("tf32x3", 16, 4, 3, 4),
    ("tf32x3", 16, 4, 1, 4),
    ("tf32x3", 16, 8, 3, 8),
    ("ieee", 16, 4, 3, 8),
]


def set_variant(prec: str, block_v: int, warps: int, stages: int, wy_warps: int) -> None:
    chunked_delta.DOT_PRECISION, chunked_delta.BLOCK_V = prec, block_v
    chunked_delta.STATE_WARPS, chunked_delta.STATE_STAGES = warps, stages
    chunked_delta.WY_WARPS = wy_warps


def pool(kind: str, slots: int) -> list[torch.Tensor]:
    if kind == "chunked":  # state, open k, v, g, beta
        shapes = ((HV, DK, DV), (C, HK, DK), (C, HV, DV), (C, HV), (C, HV))
    else:  # state, open k, gamma, u
        shapes = ((HV, DK, DV), (C, HK, DK), (C, HV), (C, HV, DV))
    return [torch.zeros((slots, *s), device="cuda") for s in shapes]


def call(kind: str):
    return (chunked_delta.chunked_delta_rule_pooled if kind == "chunked"
            else gated_delta.gated_delta_rule_pooled)  # fmt: skip


def warm_call(kind: str, b: int, n: int, start: int):
    """A pooled call of b sequences x n rows from position `start`, run three times (kernels
    compiled): returns it as a function of no arguments."""
    x = inputs(b * n, 1)
    state = pool(kind, b)
    seqs = PooledRows.build([n] * b, [start] * b, list(range(b)), C, x[0].device)
    fn = call(kind)

    def run() -> None:
        fn(*x, *state, seqs)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    return run


def time_call(kind: str, b: int, n: int, start: int) -> float:
    """Microseconds per pooled call of b sequences x n rows from position `start`."""
    run = warm_call(kind, b, n, start)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        run()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 10 * 1e3


def profile_call(kind: str, b: int, n: int, start: int, calls: int = 10) -> dict[str, float]:
    """Each kernel's GPU microseconds per pooled call of b sequences x n rows."""
    run = warm_call(kind, b, n, start)
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            times[ev.key[:60]] = ev.device_time_total / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def run_split(x: list[torch.Tensor], split: list[int]) -> tuple[torch.Tensor, dict]:
    state, outs, bounds, start = pool("chunked", 1), [], {}, 0
    for n in split:
        part = [t[start : start + n].contiguous() for t in x]
        seqs = PooledRows.build([n], [start], [0], C, x[0].device)
        out, b = chunked_delta.chunked_delta_rule_pooled(*part, *state, seqs)
        outs.append(out)
        bounds.update({p: b[i].clone() for i, (_, p) in enumerate(seqs.boundaries)})
        start += n
        if start % C == 0:
            bounds[start] = state[0][0].clone()
    return torch.cat(outs), bounds


def recurrence(x: list[torch.Tensor]) -> torch.Tensor:
    q, k, v, g, beta = (t.double().cpu() for t in x)
    s = torch.zeros(HV, DK, DV, dtype=torch.float64)
    outs = []
    for t in range(q.shape[0]):
        kt, qt = k[t].repeat_interleave(HV // HK, 0), q[t].repeat_interleave(HV // HK, 0)
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", kt, s))
        s = s + kt[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", qt, s))
    return torch.stack(outs)


def check(n: int = 200) -> dict:
    x = inputs(n, 0)
    one, b_one = run_split(x, [n])
    rows, b_rows = run_split(x, [1] * n)
    rng = random.Random(0)
    split, left = [], n
    while left:
        split.append(min(left, rng.randint(1, 70)))
        left -= split[-1]
    rnd, b_rnd = run_split(x, split)
    want = recurrence(x)
    return {
        "outputs_equal": torch.equal(one, rows) and torch.equal(one, rnd),
        "boundaries_equal": all(
            torch.equal(b_one[p], b_rows[p]) and torch.equal(b_one[p], b_rnd[p]) for p in b_one
        ),  # fmt: skip
        "boundaries": len(b_one),
        "rel_err": ((one.double().cpu() - want).abs().max() / want.abs().max()).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true", help="each kernel's time per call")
    parser.add_argument("--variants", action="store_true", help="the chunked kernels' settings")
    args = parser.parse_args()
    shapes = {"4x2048": (4, 2048, 0), "64x128": (64, 128, 0), "64x1@5": (64, 1, 5),
              "64x1@31": (64, 1, 31)}  # fmt: skip
    if args.variants:
        for variant in VARIANTS:
            set_variant(*variant)
            times = {name: time_call("chunked", *shape) for name, shape in shapes.items()}
            inv = check()
            print(variant, " ".join(f"{k} {t:.1f} us" for k, t in times.items()),
                  f"equal {inv['outputs_equal']} {inv['boundaries_equal']} "
                  f"rel_err {inv['rel_err']:.2e}", flush=True)  # fmt: skip
        return
    if args.profile:
        for kind in ("recurrent", "chunked"):
            for name, shape in shapes.items():
                times = profile_call(kind, *shape)
                print(f"{kind} {name}: " + ", ".join(f"{k} {t:.1f} us" for k, t in times.items()))
        return
    result = {"device": torch.cuda.get_device_name(), "us": {}}
    print(f"{'kernel':>10s} " + " ".join(f"{s + ' us':>12s}" for s in shapes)
          + f" {'prefill rows/s':>15s}")  # fmt: skip
    for kind in ("recurrent", "chunked"):
        times = {name: time_call(kind, *shape) for name, shape in shapes.items()}
        result["us"][kind] = times
        rate = 4 * 2048 / (times["4x2048"] * 1e-6)
        print(f"{kind:>10s} " + " ".join(f"{t:12.1f}" for t in times.values()) + f" {rate:15.0f}")
    result["invariance"] = check()
    print("chunked invariance:", result["invariance"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
