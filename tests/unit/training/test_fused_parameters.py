"""The training module's fused linears (lockstep/training/fused_parameters.py): q|k|v and gate|up
parameters are rows of one buffer each, so a step concatenates no weight; `state_dict()` stays
canonical; logprobs, gradients and optimizer steps are bit for bit those of the same module
whose parameters are separate tensors (the control: it concatenates them every step)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lockstep.models.resolver import resolve_model
from lockstep.models.spec import ModelSpec
from lockstep.training import LockstepForCausalLM

SOURCE = "random:tiny-qwen3"
SEQUENCES = [[5, 9, 300, 7, 11, 2], [1, 2, 3], [400, 17]]
CPU = torch.device("cpu")


class _Concatenations(TorchDispatchMode):
    """The shapes of every tensor `torch.cat` makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat:
            self.shapes.add(tuple(out.shape))
        return out


def _fused_shapes(spec: ModelSpec) -> set[tuple[int, ...]]:
    """The decoder's fused q|k|v and gate|up weights' shapes."""
    h = spec.hidden_size
    return {(spec.q_size + 2 * spec.kv_size, h), (2 * spec.intermediate_size, h)}


def _separate(model: LockstepForCausalLM) -> LockstepForCausalLM:
    """`model` with each parameter moved to a tensor of its own (each step then concatenates
    the fused linears' rows, the decoder's own preparation)."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def test_state_dict_is_canonical_and_the_fused_rows_share_one_buffer() -> None:
    loaded = resolve_model(SOURCE)
    model = LockstepForCausalLM(loaded, torch.float32, CPU)
    expected = dict(loaded.iter_weights(torch.float32, CPU))
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].shape == tensor.shape and torch.equal(state[name], tensor), name
    assert sorted(n for n, _ in model.named_parameters()) == sorted(expected)
    for layer in range(model.spec.num_layers):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        for names in ([a + f"{x}_proj.weight" for x in "qkv"],
                      [m + "gate_proj.weight", m + "up_proj.weight"]):  # fmt: skip
            rows = [model.get_parameter(n) for n in names]
            for before, after in zip(rows, rows[1:], strict=False):
                assert after.data_ptr() == before.data_ptr() + before.nbytes, names


def test_a_step_concatenates_no_weight_and_keeps_the_bits_and_gradients() -> None:
    loaded = resolve_model(SOURCE)
    fused = LockstepForCausalLM(loaded, torch.float32, CPU)
    separate = _separate(LockstepForCausalLM(loaded, torch.float32, CPU))
    fused_shapes = _fused_shapes(fused.spec)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fused, separate)]
    for step in range(2):
        with _Concatenations() as seen:
            out = fused(SEQUENCES)
        assert not seen.shapes & fused_shapes, step
        with _Concatenations() as seen:
            ref = separate(SEQUENCES)
        assert seen.shapes >= fused_shapes, step  # the control: it concatenates every step
        assert torch.equal(out.logprobs, ref.logprobs), step
        for o, optimizer in zip((out, ref), optimizers, strict=True):
            optimizer.zero_grad()
            (-(o.logprobs * torch.linspace(-1, 1, o.logprobs.numel())).sum()).backward()
        grads = {n: p.grad for n, p in separate.named_parameters()}
        for name, p in fused.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, grads[name]), (step, name)
        for optimizer in optimizers:
            optimizer.step()
    # The optimizer's in-place updates reached the fused buffers: the updated state gives
    # the same bits, and it moved.
    state = fused.state_dict()
    assert all(torch.equal(t, separate.state_dict()[n]) for n, t in state.items())
    assert not torch.equal(state["model.layers.0.self_attn.k_proj.weight"],
                           dict(loaded.iter_weights(torch.float32, CPU))[
                               "model.layers.0.self_attn.k_proj.weight"])  # fmt: skip
    assert torch.equal(fused(SEQUENCES).logprobs, separate(SEQUENCES).logprobs)


def test_a_parameter_replaced_by_assign_falls_back_to_concatenation() -> None:
    loaded = resolve_model(SOURCE)
    model = LockstepForCausalLM(loaded, torch.float32, CPU)
    before = model(SEQUENCES).logprobs
    state = {n: t.clone() for n, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # every parameter a tensor of its own now
    with _Concatenations() as seen:
        after = model(SEQUENCES).logprobs
    assert seen.shapes >= _fused_shapes(model.spec)
    assert torch.equal(before, after)
