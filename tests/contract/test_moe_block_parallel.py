"""The MoE layer of Qwen3.5-MoE (routed experts beside a sigmoid-gated shared expert) under
tensor and expert parallelism, as a block: the model itself is hybrid (Gated DeltaNet), which
runs at tp 1, so its sparse layer is prepared and run alone, at TP 1 and on two ranks that
are threads of this process joined by a real gloo group (lockstep/parallel/collectives.py).

* TP 2 and EP 2 give each rank the output of TP 1 under the chunked reduction, bit for bit,
  for 3, 5 and 23 tokens (the partials gathered, sent by blocks of slots, sent by blocks of
  tokens).
* Control: TP 1's default reduction (`Ops.moe` and the one-call shared down projection)
  gives other bits.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lockstep.models.blocks.base import BuildContext, PrepareContext, Step
from lockstep.models.resolver import resolve_model
from lockstep.ops import get_ops
from lockstep.parallel.collectives import Collectives
from lockstep.parallel.layers import TensorParallel
from lockstep.parallel.sharding import ShardPlan
from tests.support.tiny_hf import save_tiny

LAYER = 3  # a full-attention layer's MLP: every Qwen3.5-MoE layer is sparse


class _NoRouting:
    """The layer's KV storage as the block reads it: no routing store."""

    routed_experts = None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    save_tiny("qwen3_5_moe", folder)
    loaded = resolve_model(str(folder), 0, None)
    # The block reads the experts' fields alone; the linear-attention layers (which keep the
    # model at tp 1) are set aside so that a ShardPlan of 2 ranks can be made.
    spec = dataclasses.replace(loaded.spec, linear=None)
    prefix = f"model.layers.{LAYER}.mlp."
    weights = {n: t for n, t in loaded.iter_weights(torch.float32, "cpu") if n.startswith(prefix)}
    return spec, weights


def _run(spec, weights, plan: ShardPlan, reduction: str, coll, x: torch.Tensor):
    """The layer's output on this rank, and the shape of its experts' gate_up (the shard)."""
    ops = get_ops("cpu", "deterministic")
    parallel = TensorParallel(ops, plan, reduction, coll)
    block = spec.layer_plans[LAYER].mlp
    context = PrepareContext(spec, parallel, torch.float32, torch.device("cpu"))
    target = f"layers.{LAYER}.mlp."
    parts = {
        e.target.removeprefix(target): block.prepare(e, [weights[n] for n in e.sources], context)
        for e in block.layout(spec, LAYER, "mlp")
    }
    empty = torch.empty(0)
    w = block.build(parts, BuildContext(spec, plan, empty, empty, 0, LAYER))
    out = block.forward(ops, x, w, Step(None, _NoRouting(), parallel))  # type: ignore[arg-type]
    return out, tuple(w.layer.gate_up.shape[:2])


def _two_ranks(spec, weights, ep: int, x: torch.Tensor) -> list[tuple]:
    store = dist.HashStore()
    outs: list[tuple | BaseException | None] = [None, None]

    def rank(r: int) -> None:
        try:
            coll = Collectives(store, r, 2, torch.device("cpu"), timedelta(seconds=60))
            outs[r] = _run(spec, weights, ShardPlan(spec, 2, r, ep), "chunked", coll, x)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outs[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return outs  # type: ignore[return-value]


def test_gated_shared_expert_layer_at_tp_2_and_ep_2(model) -> None:
    spec, weights = model
    assert spec.moe is not None and spec.moe.shared_expert_size and spec.moe.shared_expert_gated
    experts, width = spec.moe.num_experts, spec.moe.intermediate_size
    # TP: every expert, half its columns; EP: half the experts, whole.
    shards = {1: (experts, width), 2: (experts // 2, 2 * width)}
    # The three ways the experts' partials travel at TP 2 (lockstep/parallel/experts.py): 3
    # tokens (6 slots) gathered whole; 5 tokens (10 slots) by blocks of slots; 23 tokens by
    # blocks of tokens, combined where they are added.
    for rows in (3, 5, 23):
        x = torch.randn(rows, spec.hidden_size, generator=torch.Generator().manual_seed(rows))
        single, whole = _run(spec, weights, ShardPlan(spec, 1, 0), "chunked", None, x)
        assert whole == (experts, 2 * width)
        for ep in (1, 2):
            for r, (out, shard) in enumerate(_two_ranks(spec, weights, ep, x)):
                assert shard == shards[ep], f"ep={ep} rank {r} holds {shard}"
                assert torch.equal(out, single), f"rows={rows} ep={ep} rank {r}"
    default, _ = _run(spec, weights, ShardPlan(spec, 1, 0), "ranks", None, x)
    assert not torch.equal(default, single), "the control gave the chunked bits"
