"""Training with the sampler's bits: a differentiable forward whose logprobs equal the engine's
bit for bit (docs/training.md).

    from lockstep.training import LockstepForCausalLM
    model = LockstepForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    out = model(token_id_lists)            # out.logprobs: LLM.score's bits, differentiable

The weights go back to a `lockstep serve` process through `lockstep.training.weight_sync`
(docs/rl.md).
"""

from lockstep.training.model import LockstepForCausalLM, PackedOutput

__all__ = ["LockstepForCausalLM", "PackedOutput"]
