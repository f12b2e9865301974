"""The communication plan of one decode step at TP 8 and EP 8 for the largest MoE models: bytes
every GPU receives per step, the same for the conventional collectives, and the share of a
step they are expected to take on NVLink. A computed plan, not a measurement: the GPU run
(tests/gpu) is what confirms or corrects it.

Lockstep's collectives (lockstep/parallel): every sum over ranks is done by one rank in a
fixed order, so partials travel in float32, never reduced in flight. A chunked reduction of
R rows (`TensorParallel.reduce`; R = T tokens, or T k (token, expert) slots for the routed
experts under TP, lockstep/parallel/experts.py):

    R < 4 tp (decode of few tokens): one all-gather of each rank's 8 / tp chunk partials
        -> each GPU receives (tp - 1) x (8 / tp) x R x H x 4 bytes
    R >= 4 tp: an all-to-all of each rank's chunk partials by blocks of R / tp rows, the
        tree on each block's rank, an all-gather of the sums (two collectives)
        -> (tp - 1) x (8 / tp + 1) x ceil(R / tp) x H x 4 bytes
    routed experts, TP, T >= 4 tp: the blocks are of tokens, and each block's rank also
        combines its tokens' k slots, so one row a token comes back
        -> (tp - 1) x (8 / tp x k + 1) x ceil(T / tp) x H x 4 bytes
    routed experts, EP: each owner's slots [~T k / ep, H] fp32 all-gathered
        -> (ep - 1) x ceil(T k / ep) x H x 4 bytes (experts evenly loaded)
    embedding rows and the vocabulary-parallel logits: all-gathers of [T, H] and [T, V / tp]

The conventional plan, for comparison: a ring all-reduce of [T, H] in bf16 per row-parallel
linear and per MoE layer (each GPU receives 2 (tp - 1) / tp x T x H x 2 bytes), and EP as
an all-to-all dispatch and combine of T k rows of H in bf16 ((ep - 1) / ep of them each way).

Time = bytes received / the link rate (900 GB/s: NVLink 4, H100 and H200) + one latency per
collective (`--latency-us`, an assumption). The decode step's floor is the weight bytes each
GPU streams from HBM (its 1/8 of the non-expert weights and of the experts the batch touches,
assuming tokens route uniformly) at `--hbm-tbps` (4.27 TB/s: docs/results.md, the H200's
measured copy rate). Share = communication time / (floor + communication time).

    python scripts/parallel_cost_table.py            # table, then one JSON document
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from lockstep.engine.memory import GIB, RankWeights
from lockstep.models.presets import PRESETS
from lockstep.models.spec import ModelSpec
from lockstep.parallel.layers import SCATTER_ROWS_PER_RANK
from lockstep.parallel.sharding import CHUNKS

MODELS = {"DeepSeek-V3 (FP8)": "deepseek-v3-fp8", "Qwen3-235B-A22B (bf16)": "qwen3-235b-a22b"}


@dataclass(frozen=True)
class StepCost:
    model: str
    route: str  # "TP 8" or "EP 8"
    batch: int
    collectives: int
    lockstep_mb: float  # MB received per GPU per decode step
    conventional_mb: float
    floor_ms: float  # the HBM weight stream of one step
    lockstep_ms: float  # its communication at the link rate, plus latencies
    conventional_ms: float
    lockstep_share: float
    conventional_share: float
    weights_gib_per_gpu: float


def _weight_bytes(spec: ModelSpec) -> int:
    """Bytes per parameter as the model is served (FP8: 1, bf16: 2)."""
    return 1 if spec.fp8 is not None else 2


def _floor_bytes(spec: ModelSpec, degree: int, batch: int) -> float:
    """Weight bytes one GPU reads in a decode step of `batch` tokens: its share of the
    non-expert weights and of the experts the batch touches (uniform routing)."""
    w = RankWeights.of(spec, _weight_bytes(spec), degree, degree)
    if spec.moe is None:
        return w.bytes
    e, k = spec.moe.num_experts, spec.moe.top_k
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts per layer
    experts = w.experts * touched / e
    return ((experts + w.sharded) / degree + w.replicated) * w.width


def chunked_reduction(rows: int, width: int, degree: int) -> tuple[float, int]:
    """Bytes one GPU receives for a chunked reduction of `rows` x `width` float32 partials,
    and its collectives (module docstring; `SCATTER_ROWS_PER_RANK` picks the path)."""
    per_rank = CHUNKS // degree
    if rows < SCATTER_ROWS_PER_RANK * degree:
        return (degree - 1) * per_rank * rows * width * 4, 1
    block = math.ceil(rows / degree)
    return (degree - 1) * (per_rank + 1) * block * width * 4, 2


def expert_reduction(tokens: int, k: int, width: int, degree: int) -> tuple[float, int]:
    """Bytes and collectives of the routed experts' reduction under TP: by blocks of tokens
    (each block's k slots' partials to its rank, one sum per token back) from
    SCATTER_ROWS_PER_RANK tokens a rank, else `chunked_reduction` of the T k slots."""
    if tokens < SCATTER_ROWS_PER_RANK * degree:
        return chunked_reduction(tokens * k, width, degree)
    block = math.ceil(tokens / degree)
    per_rank = CHUNKS // degree
    return (degree - 1) * (per_rank * k + 1) * block * width * 4, 2


def step_cost(
    name: str, spec: ModelSpec, route: str, degree: int, batch: int, link: float, latency: float,
    hbm: float,
) -> StepCost:  # fmt: skip
    """One decode step of `batch` tokens at `degree` (module docstring)."""
    assert spec.moe is not None
    h, v, t, k = spec.hidden_size, spec.vocab_size, batch, spec.moe.top_k
    sparse = len(spec.moe.sparse_layers)
    dense = spec.num_layers - sparse
    shared = 1 if spec.moe.shared_expert_size else 0
    ring = 2 * (degree - 1) / degree * 2  # bf16 ring all-reduce, per element
    # Attention's o_proj in every layer, the dense MLPs' down, the shared experts' down.
    linears = spec.num_layers + dense + shared * sparse
    per_linear, calls = chunked_reduction(t, h, degree)
    ours, theirs = linears * per_linear, linears * t * h * ring
    collectives = linears * calls + 2
    # One all-reduce (TP) or two all-to-alls (EP) per MoE layer, conventionally.
    conventional = linears + sparse * (1 if route == "TP" else 2) + 2
    if route == "TP":
        per_layer, calls = expert_reduction(t, k, h, degree)
        ours += sparse * per_layer
        collectives += sparse * calls
        theirs += sparse * t * h * ring
    else:
        ours += sparse * (degree - 1) * math.ceil(t * k / degree) * h * 4
        collectives += sparse
        theirs += sparse * 2 * (degree - 1) / degree * t * k * h * 2
    # The embedding's rows and the logits, both all-gathered in float32 either way.
    ends = (degree - 1) * t * h * 4 + (degree - 1) * t * math.ceil(v / degree) * 4
    ours += ends
    theirs += ends
    floor = _floor_bytes(spec, degree, batch) / hbm
    ours_s = ours / link + collectives * latency
    theirs_s = theirs / link + conventional * latency
    weights = RankWeights.of(spec, _weight_bytes(spec), degree, degree if route == "EP" else 1)
    return StepCost(
        name, f"{route} {degree}", batch, collectives, ours / 1e6, theirs / 1e6, floor * 1e3,
        ours_s * 1e3, theirs_s * 1e3, ours_s / (floor + ours_s), theirs_s / (floor + theirs_s),
        weights.bytes / GIB,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degree", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--link-gbps", type=float, default=900.0, help="NVLink GB/s per GPU")
    parser.add_argument("--latency-us", type=float, default=10.0, help="per collective")
    parser.add_argument("--hbm-tbps", type=float, default=4.27, help="HBM TB/s per GPU")
    args = parser.parse_args()
    rows = [
        step_cost(
            name,
            PRESETS[preset].spec,
            route,
            args.degree,
            batch,
            args.link_gbps * 1e9,
            args.latency_us * 1e-6,
            args.hbm_tbps * 1e12,
        )  # fmt: skip
        for name, preset in MODELS.items()
        for route in ("TP", "EP")
        for batch in args.batches
    ]
    head = ("model", "route", "batch", "coll.", "ours MB", "conv. MB", "floor ms", "ours ms",
            "conv. ms", "ours %", "conv. %", "GiB/GPU")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in rows:
        cells = (r.model, r.route, r.batch, r.collectives, f"{r.lockstep_mb:.1f}",
                 f"{r.conventional_mb:.1f}", f"{r.floor_ms:.2f}", f"{r.lockstep_ms:.2f}",
                 f"{r.conventional_ms:.2f}", f"{100 * r.lockstep_share:.0f}",
                 f"{100 * r.conventional_share:.0f}", f"{r.weights_gib_per_gpu:.1f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    print(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}))


if __name__ == "__main__":
    main()
