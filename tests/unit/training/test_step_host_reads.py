"""A training step reads its sequence lengths from the host, never from the attention
metadata on the device (on CUDA each such read is a synchronization, one per attention layer):
the forward and backward run with the metadata read refused; the control, the differentiable
ops built without the lengths, reads it at every attention layer."""

from __future__ import annotations

import pytest
import torch

from lockstep.ops.base import AttentionMeta
from lockstep.training import LockstepForCausalLM, differentiable_ops

SEQUENCES = [[5, 9, 30, 7, 11, 2, 8], [1, 2, 3], [40, 17, 3, 3]]


def test_a_step_reads_no_lengths_from_the_attention_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = LockstepForCausalLM.from_pretrained("random:tiny-qwen3")
    reads: list[int] = []
    original = differentiable_ops._cold_lengths

    def counted(meta: AttentionMeta) -> list[int]:
        reads.append(1)
        return original(meta)

    monkeypatch.setattr(differentiable_ops, "_cold_lengths", counted)
    out = model(SEQUENCES)
    (-out.logprobs.sum()).backward()
    assert not reads
    # The control: the same ops without the host's lengths read them once per attention layer.
    base = differentiable_ops.DifferentiableOps
    monkeypatch.setattr(differentiable_ops, "DifferentiableOps",
                        lambda ops, seq_lens=None: base(ops))  # fmt: skip
    import lockstep.training.model as model_module

    monkeypatch.setattr(model_module, "DifferentiableOps", differentiable_ops.DifferentiableOps)
    again = model(SEQUENCES)
    assert len(reads) == model.spec.num_layers
    assert torch.equal(again.logprobs, out.logprobs)
