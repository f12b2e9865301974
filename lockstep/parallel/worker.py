"""A tensor-parallel worker: rank r > 0 of an engine, in its own process.

It joins the process group, loads its shard of the model and a KV store of its KV heads, then
runs every command rank 0 sends through its pipe, in order, until "stop". Rank 0 sends each
step's forward batch (the scheduler's plan, laid out) before running the same step itself, so
every rank enters the same collectives in the same order.

    message to rank 0         when
    ("joining", None)         started, about to join the process group
    ("ready", None)           its shard is loaded
    ("error", text)           it failed (then it exits with status 1)

    command                   the worker                         rank 0 (lockstep.parallel.group)
    ("kv_slots", n)           allocates its KV store of n slots   after sizing its pool
    ("linear_slots", (s, n))  hybrid: its state pool of s slots   after sizing its own
                              and snapshot pool of n
    ("linear_resume", (s, n)) fills state slot s from snapshot    after its own resume
                              slot n (None: zeros)                (lockstep/parallel/linear_states.py)
    ("forward", (batch, w))   Decoder.forward(batch, its store),  the same, then samples
                              hybrid: its states of wires w
    ("cold_prefill", tokens)  a cold prefill in a scratch store,  the same, gathers the heads
                              then gathers its KV heads (and      (and the state)
                              linear state)
    ("read_kv", slots)        gathers its KV heads at `slots`     assembles [L, n, Hkv, D]
    ("stop",)                 exits with status 0

A closed pipe (rank 0 is gone) or a failed collective (another rank is gone) ends the worker
with status 1 and one line on stderr naming its rank and the cause. On Linux the worker also
asks the kernel to kill it when its parent dies, so no worker outlives the engine's process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from lockstep.config import EngineConfig
from lockstep.cpu_threads import usable_cores
from lockstep.models.decoder import Decoder
from lockstep.models.resolver import LoadedModel, resolve_model
from lockstep.ops import get_ops
from lockstep.parallel.collectives import Collectives
from lockstep.parallel.layers import TensorParallel
from lockstep.parallel.linear_states import RankStates, gather_state
from lockstep.parallel.sharding import ShardPlan

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer. A dead peer is noticed sooner: its sockets close
# (and rank 0's watchdog stops every worker); this bounds a peer that hangs.
COLLECTIVE_TIMEOUT_S = 300


class KVShard:
    """One rank's KV store, k and v [layers, slots, local KV heads, D] (rank 0 uses the KV
    pool, whose allocator decides the slots for every rank)."""

    def __init__(self, plan: ShardPlan, num_slots: int, dtype: torch.dtype, device: torch.device):
        spec = plan.spec
        shape = (len(spec.kv_layers), num_slots, plan.num_local_kv_heads, spec.cache_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        # MLA keeps one latent row per token: its values are its keys' first columns.
        self.v = torch.zeros(shape, dtype=dtype, device=device) if spec.cache_values else self.k
        self.routed_experts = None  # the routing store is rank 0's (every rank routes alike)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r computes on cuda:r on CUDA, on the CPU otherwise."""
    if config.resolved_device == "cuda":
        return torch.device("cuda", rank)
    return torch.device("cpu")


def join_group(config: EngineConfig, rank: int, store: dist.Store) -> Collectives:
    """Join the engine's process group through `store` (rank 0 hosts it): NCCL on CUDA,
    gloo on the CPU."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return Collectives(store, rank, config.tp, device, timeout)


def set_threads(config: EngineConfig) -> None:
    """`num_threads` when given, else an equal share per rank of the cores this process
    may use (affinity and CPU quota)."""
    torch.set_num_threads(config.num_threads or max(1, usable_cores() // config.tp))


def load_rank_decoder(
    config: EngineConfig,
    loaded: LoadedModel,
    rank: int,
    max_position: int,
    collectives: Collectives | None,
) -> Decoder:
    """Rank `rank`'s shard of the model (`collectives`: its process group when tp > 1)."""
    device = rank_device(config, rank)
    ops = get_ops(device.type, config.mode, config.mla_fused_input)
    plan = ShardPlan(loaded.spec, config.tp, rank, config.ep)
    reduction = config.resolved_tp_reduction
    parallel = TensorParallel(ops, plan, reduction, collectives)
    dtype = getattr(torch, config.resolved_dtype)
    kv_dtype = getattr(torch, config.resolved_kv_dtype)
    decoder = Decoder.load(
        loaded, ops, dtype, device, max_position, parallel=parallel, kv_dtype=kv_dtype
    )
    if decoder.linear_layout is not None:  # hybrid models: the rule's form (config.GDN_KERNELS)
        decoder.linear_layout = dataclasses.replace(decoder.linear_layout, kernel=config.gdn_kernel)
    return decoder


def gather_kv(
    decoder: Decoder, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's KV heads k, v [layers, n, local heads, D] joined into [layers, n, Hkv, D]
    (each replicated head taken once, from its first holder). A collective: every rank calls
    it; all get the result."""
    plan = decoder.plan
    collectives = decoder.parallel.collectives
    assert collectives is not None
    owners = [ShardPlan(plan.spec, plan.tp, r).kv_owner for r in range(plan.tp)]
    ks = [t for t, own in zip(collectives.all_gather(k), owners, strict=True) if own]
    vs = [t for t, own in zip(collectives.all_gather(v), owners, strict=True) if own]
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def worker_main(config: EngineConfig, rank: int, store_port: int, conn: Connection) -> None:
    """The worker process's entry point (multiprocessing, spawn)."""
    die_with_parent()
    logging.basicConfig(format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    try:
        set_threads(config)
        store = dist.TCPStore("127.0.0.1", store_port, config.tp, is_master=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip
        conn.send(("joining", None))  # rank 0 joins only once every worker got this far
        collectives = join_group(config, rank, store)
        loaded = resolve_model(config.model, config.random_seed, config.revision)
        max_position = config.max_model_len or loaded.spec.max_position
        decoder = load_rank_decoder(config, loaded, rank, max_position, collectives)
        conn.send(("ready", None))
        _serve(decoder, conn)
    except EOFError:
        print(f"lockstep tp worker rank {rank}: rank 0 is gone, exiting", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # one line naming the rank and the cause, then a failed exit
        print(f"lockstep tp worker rank {rank} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


def _serve(decoder: Decoder, conn: Connection) -> None:
    kind, num_slots = conn.recv()
    assert kind == "kv_slots", kind
    store = KVShard(decoder.plan, num_slots, decoder.dtype, decoder.device)
    states: RankStates | None = None
    while True:
        command, arg = conn.recv()
        if command == "stop":
            return
        if command == "forward":
            batch, wires = arg
            if wires is not None:
                assert states is not None, "a hybrid step before linear_slots"
                batch = dataclasses.replace(batch, linear_states=states.step_states(wires))
            decoder.forward(batch.to(decoder.device), store)
        elif command == "linear_slots":
            assert decoder.linear_layout is not None
            states = RankStates(decoder.linear_layout, *arg)
        elif command == "linear_resume":
            assert states is not None, "linear_resume before linear_slots"
            states.resume(*arg)
        elif command == "cold_prefill":
            _, scratch = decoder.cold_prefill(arg)
            gather_kv(decoder, scratch.k, scratch.v)
            if scratch.linear_state is not None:
                assert decoder.parallel.collectives is not None
                gather_state(scratch.linear_state, decoder.parallel.collectives)
        elif command == "read_kv":
            index = arg.to(decoder.device)
            gather_kv(decoder, store.k[:, index], store.v[:, index])
        else:
            raise ValueError(f"unknown command {command!r}")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits, however the parent ended."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


__all__ = ["KVShard", "die_with_parent", "gather_kv", "load_rank_decoder", "worker_main"]
