"""Weights from the trainer's process to a `lockstep serve` engine over a process group, the
way SGLang's RL frameworks send them (docs/rl.md):

    trainer (rank 0)                                  lockstep serve (rank rank_offset)
    ----------------                                  ---------------------------------
    POST /init_weights_update_group  -- both join --  join_weight_group(..., rank_offset)
    group = join_weight_group(addr, port, 0, 2)
    POST /update_weights_from_distributed             receives each tensor by broadcast
      {names, dtypes, shapes, weight_version}         (src 0), checks them, swaps them in
    broadcast_weights(model, group)
    POST /destroy_weights_update_group                leaves the group

`push_weights(url, model, group)` does the last two steps together (the request goes out on a
thread while this process broadcasts: each side waits for the other). The group is the one
SGLang's helpers make (a TCP rendezvous at master_address:master_port, a store prefixed with
the group name, a process group of its own beside any default one), so a trainer that already
joins SGLang's group with its own helper talks to Lockstep unchanged. `backend`: gloo for
tensors on the CPU, nccl for CUDA tensors.

The server refuses, before any weight changes, a set whose names, shapes or dtypes do not fit
the served model; the old weights then keep serving, bit for bit.
"""

from __future__ import annotations

import inspect
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import distributed_c10d as c10d

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
DEFAULT_TIMEOUT_S = 600.0
BACKENDS = ("gloo", "nccl")


def join_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Join (rank 0: create) the process group `group_name` of `world_size` ranks that meet at
    master_address:master_port, apart from any default group this process has. Blocks until
    every rank has joined or `timeout_s` passes. Returns the group for `broadcast_weights` and
    `leave_weight_group`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported: expected one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # torch's private helper is the only road to a group without a default world (the RL
    # frameworks' helpers take it too); it renamed pg_options to backend_options.
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        timeout=timeout, **{options: None},
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_weight_group(group: Any) -> None:
    """Destroy a group made by `join_weight_group` (every rank calls it)."""
    torch.distributed.destroy_process_group(group)


def named_weights(model: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a weight update sends: a module's `state_dict()` (Hugging
    Face names, LockstepForCausalLM's), or a state dict as given."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    return [(name, tensor.detach()) for name, tensor in state.items()]


def update_request(
    weights: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None, **fields: Any
) -> dict[str, Any]:
    """The body of `POST /update_weights_from_distributed` for `weights`, in SGLang's fields:
    `names`, `dtypes` (torch's names: "bfloat16", "float32"), `shapes`, `weight_version`, and
    any other field given (`group_name`, `abort_all_requests`, `flush_cache`)."""
    pairs = list(weights)
    body = {
        "names": [name for name, _ in pairs],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
        "shapes": [list(t.shape) for _, t in pairs],
        **fields,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def broadcast_weights(
    weights: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    group: Any,
    src: int = 0,
) -> None:
    """Broadcast each tensor, in order, from rank `src` of `group` (the order and the shapes
    of the matching `update_request`). Tensors are sent as they are: contiguous, on the
    backend's device (the CPU for gloo, CUDA for nccl)."""
    pairs = named_weights(weights) if isinstance(weights, (nn.Module, Mapping)) else weights
    for _, tensor in pairs:
        torch.distributed.broadcast(tensor.contiguous(), src=src, group=group)


def push_weights(
    base_url: str,
    model: nn.Module | Mapping[str, torch.Tensor],
    group: Any,
    weight_version: str | None = None,
    api_key: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **fields: Any,
) -> dict[str, Any]:
    """Send `model`'s weights to the server at `base_url` through `group` (this process is
    rank 0): `POST /update_weights_from_distributed` on a thread, the broadcasts here, then
    the server's answer. `fields`: the body's other fields (`group_name` defaults to the
    group's own name). Raises `RuntimeError` with the server's message when it refuses the
    set (its old weights then still serve); a body refused before the transfer (a group the
    server has not joined) leaves the broadcasts here to fail at the group's timeout."""
    pairs = named_weights(model)
    fields.setdefault("group_name", c10d._world.pg_names.get(group, DEFAULT_GROUP_NAME))
    body = update_request(pairs, weight_version, **fields)
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            _post(base_url, "/update_weights_from_distributed", body, api_key, timeout_s)
        ),  # fmt: skip
        daemon=True,
    )
    thread.start()
    broadcast_weights(pairs, group)
    thread.join(timeout_s)
    if not answer.get("success"):
        raise RuntimeError(f"the server refused the weights: {answer.get('message', answer)}")
    return answer


def tensor_update_request(
    model: nn.Module | Mapping[str, torch.Tensor], weight_version: str | None = None, **fields: Any
) -> dict[str, Any]:
    """The body of `POST /update_weights_from_tensor` for `model`'s weights: one safetensors
    file of them (on the host, Hugging Face names) as base64 text, `load_format`
    'safetensors', and any other field given (`abort_all_requests`). For a trainer beside
    the server (the body is about 1.33 times the weights' bytes: small models, tests)."""
    import base64

    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_weights(model):
        host = tensor.detach().to("cpu").contiguous()
        if host.untyped_storage().data_ptr() in seen:  # tied: safetensors takes no aliases
            host = host.clone()
        seen.add(host.untyped_storage().data_ptr())
        tensors[name] = host
    body = {
        "serialized_named_tensors": [base64.b64encode(save(tensors)).decode()],
        "load_format": "safetensors",
        **fields,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def _post(
    base_url: str, path: str, body: dict[str, Any], api_key: str | None, timeout_s: float
) -> dict[str, Any]:
    """POST `body` as JSON; the JSON answer (a refusal's body included)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        base_url.rstrip("/") + path, json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read() or b"{}")
        answer.setdefault("success", False)
        return answer
