"""How memory is divided at start-up: weights, the largest step's workspace, CUDA graphs, KV.

The KV pool is sized once, after the weights are on the device and before the first step;
`kv_tokens`, when given, replaces all of this (and is refused with the arithmetic when it does
not fit: `refuse_oversized_pool`). On CUDA (`cuda_kv_budget`):

    free device memory after the weights (cudaMemGetInfo, torch's cache emptied)
    |<---------- reserved ---------->|<- headroom ->|<------------ the rest ------------>|
    | step workspace, graphs, slack  | HEADROOM     | caches: kv_memory_fraction (1.0)   |

  step workspace, the largest step (max_batch_tokens rows):
    activations  rows x (4 hidden + qkv + 2 q + 3 intermediate) x activation bytes
    logits       logit rows x vocab x (activation bytes + 4 + 4): the LM head's output, its
                 float32 copy and the float32 log-softmax. Only rows that need logits get them
                 (lockstep/engine/model_runner.py): each sampling request's last row (at most
                 max_running) and prompt-logprob rows, which the scheduler bounds to
                 PROMPT_LOGPROB_ROWS a step (lockstep/engine/scheduler.py)
    sampler      SAMPLER_CHUNK_ROWS rows x vocab x SAMPLER_BYTES_PER_LOGIT: sampled rows are
                 chosen in chunks of that many (lockstep/engine/sampler.py), each needing float64
                 scores, noise, masks and top-p's sort
  CUDA graphs: one output buffer shared by every bucket (max batch x vocab float32), the graph
    pool's largest capture (its rows' activations and logits, reused by every capture), and
    each bucket's static inputs (B x C slot ids)
  slack: the split-attention workspace (at most 256 MiB, docs/gpu.md) and the cuBLAS, Triton
    and allocator overheads: WORKSPACE_SLACK_BYTES

HEADROOM_BYTES covers what the estimate leaves out: the caching allocator's fragmentation and
library workspaces outside torch. Each item above is an upper bound of what a step really
allocates (tests/gpu/test_gpu_memory.py measures the peak over whole workloads against weights
+ pool + reservation). The estimate does not depend on the mode, so both modes get the same
pool; the reference mode (stock torch) also gathers a decode step's keys and values into copies
of [batch, kv heads, context bucket, head dim] per layer, inside its CUDA graphs too, which
only the headroom holds: at a large batch times context give it a lower kv_memory_fraction.

Bytes per cached token (`bytes_per_token`): what every layer's mixer block says it keeps
per token (`Mixer.cache_bytes`): K and V per attention layer (multi-head latent attention:
one latent row of kv_lora_rank + qk_rope_head_dim values, 576 for DeepSeek-V3);
linear-attention layers keep none; with `enable_return_routed_experts` each slot also keeps
its routed experts, sparse layers x top_k ids of 2 bytes (lockstep/cache/routed_experts.py:
48 x 8 x 2 = 768 bytes for Qwen3-30B-A3B beside its 96 KiB of bf16 K/V). A hybrid model's radix snapshots
(`Mixer.cache_bytes().per_snapshot` summed over the layers, `snapshot_bytes`) come from a pool
of their own (lockstep/cache/linear_snapshots.py) whose bytes come out of the same share once,
before the KV pool takes the rest:

    cache share = kv_memory_fraction x (free - reserved - headroom)   (CPU: x available RAM)
    snapshots   = linear_snapshots x snapshot_bytes
    KV tokens   = (cache share - snapshots) // bytes_per_token

`linear_snapshots` left out: SNAPSHOTS_PER_RUNNING per running request, at most
SNAPSHOT_SHARE of the cache share (`default_linear_snapshots`). A cached prefix is reusable
only up to its last snapshot, so KV without snapshots is dead weight and snapshots without KV
are never reached: half and half keeps both useful. Four per running request: a 1k-in /
1k-out request keeps five (its prompt end, 512, 1024, 1536 and the end of its text:
lockstep/cache/linear_snapshots.py), the first two shared by the requests of one prompt. The
running requests' working states (`LinearStatePool`, a slot per running request) are
allocated before free memory is measured.

Before any weight is loaded on CUDA, `refuse_oversized_weights` refuses a model whose weights
alone exceed the free device memory of a rank (`RankWeights`, a lower bound: every parameter
at its stored width, the sharded ones split evenly over the tensor- or expert-parallel ranks,
norms and routers on every rank), with the arithmetic and the smallest degree that fits,
instead of failing mid-load; the engine logs that per-rank need at start.

On the CPU (`cpu_kv_budget`): kv_memory_fraction (0.3) of the available RAM, capped at
CPU_DEFAULT_KV_TOKEN_CAP tokens: a CPU serves few long sequences, and a pool sized from RAM
alone would zero gigabytes at start-up for nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lockstep.cache import routed_experts as routed_store
from lockstep.engine.sampler import SAMPLER_CHUNK_ROWS
from lockstep.errors import ConfigError
from lockstep.models.spec import ModelSpec

CPU_DEFAULT_KV_TOKEN_CAP = 65536
# The default snapshot pool (module docstring): per running request, and its most share of
# the memory the caches get.
SNAPSHOTS_PER_RUNNING = 4
SNAPSHOT_SHARE = 0.5
# Bytes per vocabulary entry of a row the sampler works on: index_select copies of the logits
# and log-softmax rows (4 + 4), then for sampled rows float64 scores, Gumbel noise, the noisy
# scores and their -inf fill (4 x 8), the keep mask (1), and top-p's masked, sorted, unit and
# cumulative rows (4 x 8); rounded up.
SAMPLER_BYTES_PER_LOGIT = 88
# Prompt-logprob rows (their logits) one step computes at most (the scheduler's bound).
PROMPT_LOGPROB_ROWS = 256
WORKSPACE_SLACK_BYTES = 1 << 30
# Free device memory left out of the caches: the allocator's fragmentation and workspaces the
# reservation does not itemise (docs/results.md, "Memory", has the measured peaks).
HEADROOM_BYTES = 1 << 30
GIB = float(1 << 30)


@dataclass(frozen=True)
class StepWorkspace:
    """Bytes reserved beside the KV pool on CUDA, by what they are for."""

    activations: int
    logits: int
    sampler: int
    graphs: int
    slack: int

    @property
    def total(self) -> int:
        return self.activations + self.logits + self.sampler + self.graphs + self.slack


@dataclass(frozen=True)
class SnapshotBudget:
    """A hybrid model's pool of radix snapshots: `count` slots of `snapshot_bytes` each."""

    count: int
    snapshot_bytes: int

    @property
    def total(self) -> int:
        return self.count * self.snapshot_bytes

    def describe(self, bytes_per_token: int) -> str:
        """One line: the pool and what it costs in KV tokens."""
        return (
            f"linear snapshots {self.count} x {self.snapshot_bytes / 2**20:.2f} MiB = "
            f"{self.total / GIB:.2f} GiB, the memory of {self.total // bytes_per_token} KV "
            "tokens"
        )


@dataclass(frozen=True)
class KVBudget:
    """How the KV pool's size was chosen: from `available_bytes` (free device memory after
    the weights, or available RAM), less `reserved`, times `fraction`, less the `snapshots`
    pool (hybrid models), in tokens of `bytes_per_token`; `capped`: the CPU's token cap
    applied."""

    device: str
    available_bytes: int
    reserved: StepWorkspace | None
    fraction: float
    bytes_per_token: int
    kv_tokens: int
    capped: bool = False
    snapshots: SnapshotBudget | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.reserved is not None:
            out["reserved"]["total"] = self.reserved.total
            out["headroom"] = HEADROOM_BYTES
        return out

    def describe(self) -> str:
        """One line: where the pool's memory came from (and the snapshots' share)."""
        kv = self.kv_tokens * self.bytes_per_token / GIB
        less, tail = "", ""
        if self.snapshots is not None:
            less = f" less {self.snapshots.total / GIB:.2f} GiB of linear snapshots"
            tail = "; " + self.snapshots.describe(self.bytes_per_token)
        if self.reserved is None:
            cap = f", capped at {CPU_DEFAULT_KV_TOKEN_CAP} tokens" if self.capped else ""
            return (f"KV pool {self.kv_tokens} tokens of {self.bytes_per_token} bytes ({kv:.2f} "
                    f"GiB): {self.fraction:g} of {self.available_bytes / GIB:.2f} GiB available "
                    f"RAM{less}{cap}{tail}")  # fmt: skip
        r = self.reserved
        return (
            f"KV pool {self.kv_tokens} tokens of {self.bytes_per_token} bytes ({kv:.2f} GiB): "
            f"{self.fraction:g} of {self.available_bytes / GIB:.2f} GiB free after the weights less "
            f"{r.total / GIB:.2f} GiB reserved (activations {r.activations / GIB:.2f}, logits "
            f"{r.logits / GIB:.2f}, sampler {r.sampler / GIB:.2f}, CUDA graphs "
            f"{r.graphs / GIB:.2f}, slack {r.slack / GIB:.2f}) and {HEADROOM_BYTES / GIB:.2f} "
            f"GiB of headroom{less}{tail}"
        )


def bytes_per_token(
    spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype, routed_experts: bool = False
) -> int:
    """The bytes one cached token costs in the KV pool: the sum over layers of each mixer's
    per-token bytes (snapshots have their own pool: `snapshot_bytes`), and with
    `routed_experts` its row of the routing store. `kv_heads`: this rank's KV heads."""
    kv = sum(plan.mixer.cache_bytes(spec, kv_heads, kv_dtype).per_token
             for plan in spec.layer_plans)  # fmt: skip
    return kv + (routed_store.bytes_per_token(spec) if routed_experts else 0)


def snapshot_bytes(spec: ModelSpec) -> int:
    """The bytes of one radix snapshot of a hybrid model's linear-attention state (every
    linear layer's window and state; 0 for a model without)."""
    return sum(plan.mixer.cache_bytes(spec, 1, torch.float32).per_snapshot
               for plan in spec.layer_plans)  # fmt: skip


def default_linear_snapshots(max_running: int, snapshot_bytes: int, cache_bytes: int | None) -> int:
    """The snapshot pool's size when not given: SNAPSHOTS_PER_RUNNING per running request, and
    when the caches are sized from memory (`cache_bytes`: the share they get) at most
    SNAPSHOT_SHARE of it."""
    wanted = SNAPSHOTS_PER_RUNNING * max_running
    if cache_bytes is None:
        return wanted
    return min(wanted, int(cache_bytes * SNAPSHOT_SHARE) // snapshot_bytes)


def logit_rows(max_batch_tokens: int, max_running: int) -> int:
    """The most rows one step computes logits for: every running request's sampling row and
    PROMPT_LOGPROB_ROWS prompt-logprob or speculative draft rows (the scheduler bounds both
    together), and never more than the step's rows."""
    return min(max_batch_tokens, max_running + PROMPT_LOGPROB_ROWS)


def step_workspace(
    spec: ModelSpec,
    activation_bytes: int,
    max_batch_tokens: int,
    max_running: int,
    graph_buckets: tuple[Sequence[int], Sequence[int]] | None,
    piecewise_tokens: int = 0,
) -> StepWorkspace:
    """The reservation beside the KV pool (module docstring). `graph_buckets`: the decode
    graphs' (batch buckets, context buckets), None without CUDA graphs; `piecewise_tokens`:
    the largest step of the piecewise graphs (0: none), whose pool holds that step's
    activations beside the eager ones, plus the static q and o and final hidden rows."""
    per_row = (
        4 * spec.hidden_size
        + spec.q_size
        + 2 * spec.kv_size
        + 2 * spec.q_size
        + 3 * spec.intermediate_size
    )
    vocab = spec.vocab_size
    graphs = 0
    if graph_buckets is not None:
        batches, contexts = graph_buckets
        largest = max(batches)
        # The shared output, then the largest capture's rows (activations, bf16 head output
        # and its float32 copy: the pool reuses them for every other capture).
        graphs = largest * vocab * 4 + largest * (per_row + vocab) * activation_bytes
        graphs += largest * vocab * 4
        for b in batches:
            for c in contexts:
                graphs += 6 * b * 8 + (4 * b + 2 + b * c) * 4  # static inputs
    if piecewise_tokens:
        static = 2 * spec.q_size + spec.hidden_size
        graphs += piecewise_tokens * ((per_row + static) * activation_bytes + 3 * 8)
    return StepWorkspace(
        activations=max_batch_tokens * per_row * activation_bytes,
        logits=logit_rows(max_batch_tokens, max_running) * vocab * (activation_bytes + 4 + 4),
        sampler=min(max_running, SAMPLER_CHUNK_ROWS) * vocab * SAMPLER_BYTES_PER_LOGIT,
        graphs=graphs,
        slack=WORKSPACE_SLACK_BYTES,
    )


@dataclass(frozen=True)
class RankWeights:
    """The weights one rank of a tensor- (and expert-) parallel engine holds, in parameters:
    the routed experts (its columns of every expert under tensor parallelism, its experts
    under expert parallelism: a 1/tp share either way, lockstep/parallel/sharding.py), the
    rest that is sharded (attention, the dense and shared MLPs, embedding and LM head: 1/tp),
    and what every rank holds whole (norms, routers). `width`: bytes per parameter (1 for an
    FP8 model, whose unquantized share is not counted: a lower bound)."""

    tp: int
    ep: int
    width: int
    experts: int
    sharded: int
    replicated: int

    @classmethod
    def of(cls, spec: ModelSpec, dtype_bytes: int, tp: int, ep: int = 1) -> RankWeights:
        h = spec.hidden_size
        norms = spec.num_layers * len(spec.norm_names()) * h + h
        experts = routers = 0
        if spec.moe is not None:
            sparse, e = len(spec.moe.sparse_layers), spec.moe.num_experts
            experts = sparse * e * 3 * h * spec.moe.intermediate_size
            routers = sparse * e * h
        sharded = spec.num_parameters - experts - routers - norms
        width = 1 if spec.fp8 is not None else dtype_bytes
        return cls(tp, ep, width, experts, sharded, routers + norms)

    @property
    def bytes(self) -> float:
        """Bytes on each rank (the shares divide evenly up to a row; a lower bound)."""
        return ((self.experts + self.sharded) / self.tp + self.replicated) * self.width

    def describe(self, device: str = "GPU") -> str:
        """The arithmetic, in one line: "58.9 GiB per GPU (... x 2 bytes / tp=8 ...)"."""
        total = (self.experts + self.sharded + self.replicated) / 1e9
        degree = f"tp={self.tp}" + (f", ep={self.ep}" if self.ep > 1 else "")
        line = f"{self.bytes / GIB:.1f} GiB per {device} ({total:.2f} B parameters x {self.width} bytes"
        if self.tp == 1:
            return line + f" / {degree})"
        return (
            f"{line}: {(self.experts + self.sharded) / 1e9:.2f} B of them / {degree} (experts "
            f"{self.experts / 1e9:.2f} B), {self.replicated / 1e9:.3f} B of norms and routers "
            "on every rank)"
        )


def refuse_oversized_weights(
    name: str,
    spec: ModelSpec,
    dtype_bytes: int,
    tp: int,
    free_bytes: int,
    ep: int = 1,
    unshardable: str | None = None,
) -> None:
    """Raise `ConfigError` when `spec`'s weights cannot fit in `free_bytes` per rank at tensor
    parallelism `tp` (expert parallelism `ep`): `RankWeights`' lower bound. The message holds
    the arithmetic and the smallest degree that fits, or why sharding cannot help
    (`unshardable`: a reason of the device's, which the model's degrees do not know)."""
    from lockstep.parallel.sharding import degree_problem, supported_degrees

    need = RankWeights.of(spec, dtype_bytes, tp, ep)
    if need.bytes <= free_bytes:
        return
    degrees = [1] if unshardable else supported_degrees(spec)
    fits = [d for d in degrees if RankWeights.of(spec, dtype_bytes, d, d if ep > 1 else 1).bytes
            <= free_bytes]  # fmt: skip
    if fits and fits[0] > tp:
        flag = f"--tp {fits[0]}" + (f" --ep {fits[0]}" if ep > 1 else "")
        hint = f"{flag} fits (degrees that work: {', '.join(map(str, degrees))})"
    elif len(degrees) > 1:
        most = RankWeights.of(spec, dtype_bytes, degrees[-1], degrees[-1] if ep > 1 else 1)
        hint = (f"even tp={degrees[-1]} needs {most.bytes / GIB:.1f} GiB per GPU (degrees that "
                f"work: {', '.join(map(str, degrees))})")  # fmt: skip
    else:
        hint = f"it cannot be split over more GPUs: {unshardable or degree_problem(spec, 2)}"
    raise ConfigError(
        f"model {name} does not fit: its weights need at least {need.describe()} and the "
        f"device has {free_bytes / GIB:.1f} GiB free; {hint}"
    )


def cuda_cache_bytes(free_bytes: int, reserved: StepWorkspace, fraction: float) -> int:
    """The share of the device memory free after the weights that the caches get: `fraction`
    of what the reservation and the headroom leave."""
    return int(max(free_bytes - reserved.total - HEADROOM_BYTES, 0) * fraction)


def refuse_oversized_pool(
    kv_tokens: int,
    bytes_per_token: int,
    free_bytes: int,
    reserved: StepWorkspace,
    snapshots: SnapshotBudget | None = None,
) -> None:
    """Raise `ConfigError` when a pool of `kv_tokens` given by hand (and a hybrid model's
    snapshots) cannot fit in the device memory free after the weights beside the reservation
    and the headroom, with the arithmetic and the largest pool that fits."""
    taken = 0 if snapshots is None else snapshots.total
    room = free_bytes - reserved.total - HEADROOM_BYTES - taken
    if kv_tokens * bytes_per_token <= room:
        return
    snaps = "" if snapshots is None else f" - {taken / GIB:.2f} GiB of linear snapshots"
    raise ConfigError(
        f"kv_tokens={kv_tokens} is invalid here: {kv_tokens} x {bytes_per_token} bytes = "
        f"{kv_tokens * bytes_per_token / GIB:.2f} GiB, and {free_bytes / GIB:.2f} GiB free after "
        f"the weights - {reserved.total / GIB:.2f} GiB reserved - {HEADROOM_BYTES / GIB:.2f} GiB "
        f"headroom{snaps} leaves {max(room, 0) / GIB:.2f} GiB; expected at most "
        f"{max(room, 0) // bytes_per_token} (or leave kv_tokens out to size it from memory)"
    )


def cuda_kv_budget(
    free_bytes: int,
    bytes_per_token: int,
    reserved: StepWorkspace,
    fraction: float,
    snapshots: SnapshotBudget | None = None,
) -> KVBudget:
    """The KV pool from the device memory free after the weights, less the snapshot pool.
    Raises `ConfigError` when the reservation and the snapshots leave no room for a pool."""
    taken = 0 if snapshots is None else snapshots.total
    tokens = (cuda_cache_bytes(free_bytes, reserved, fraction) - taken) // bytes_per_token
    if tokens < 1:
        snaps, options = "", "--max-batch-tokens or --max-running"
        if snapshots is not None:
            snaps = f" and {taken / GIB:.2f} GiB by {snapshots.count} linear snapshots"
            options = "--max-batch-tokens, --max-running or --linear-snapshots"
        raise ConfigError(
            f"kv_tokens: no device memory is left for the KV pool: {free_bytes / GIB:.2f} GiB "
            f"free after the weights, {reserved.total / GIB:.2f} GiB needed by the largest "
            f"step and the CUDA graphs, {HEADROOM_BYTES / GIB:.2f} GiB of headroom{snaps}; "
            f"lower {options}, or give --kv-tokens"
        )
    return KVBudget("cuda", free_bytes, reserved, fraction, bytes_per_token, tokens,
                    snapshots=snapshots)  # fmt: skip


def cpu_kv_budget(
    available_bytes: int,
    bytes_per_token: int,
    fraction: float,
    snapshots: SnapshotBudget | None = None,
) -> KVBudget:
    """The KV pool from the available RAM less the snapshot pool, capped at
    CPU_DEFAULT_KV_TOKEN_CAP tokens. Raises `ConfigError` when the snapshots alone exceed the
    share."""
    share = int(available_bytes * fraction)
    if snapshots is not None:
        refuse_oversized_snapshots(snapshots, share, f"{fraction:g} of the available RAM")
    taken = 0 if snapshots is None else snapshots.total
    tokens = (share - taken) // bytes_per_token
    capped = tokens > CPU_DEFAULT_KV_TOKEN_CAP
    tokens = max(1, min(tokens, CPU_DEFAULT_KV_TOKEN_CAP))
    return KVBudget("cpu", available_bytes, None, fraction, bytes_per_token, tokens, capped,
                    snapshots)  # fmt: skip


def refuse_oversized_snapshots(snapshots: SnapshotBudget, room: int, what: str) -> None:
    """Raise `ConfigError` when the snapshot pool needs more than `room` bytes (`what`: where
    that room comes from, for the message), before anything is allocated."""
    if snapshots.total <= room:
        return
    raise ConfigError(
        f"linear_snapshots={snapshots.count} is invalid here: {snapshots.count} snapshots of "
        f"{snapshots.snapshot_bytes / 2**20:.2f} MiB need {snapshots.total / GIB:.2f} GiB and "
        f"{what} is {room / GIB:.2f} GiB; expected at most {room // snapshots.snapshot_bytes}"
    )


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
