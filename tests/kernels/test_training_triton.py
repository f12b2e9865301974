"""The training module on the Triton backend (what it runs on CUDA), here under the Triton
interpreter on CPU tensors, for a dense, a hybrid (Gated DeltaNet), an MLA + MoE and a
windowed (Gemma 3) model: its packed logprobs are the bits of the engine decoder on the same
backend, and its backward runs through the Triton forward's saved values. With CUDA the same
checks run in tests/gpu/test_gpu_training.py at real shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lockstep.models.decoder import Decoder
from lockstep.models.resolver import resolve_model
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.training import LockstepForCausalLM

if torch.cuda.is_available():
    pytest.skip("the GPU runs tests/gpu/test_gpu_training.py", allow_module_level=True)
from test_ops_triton import _row_local_interpreter_dot  # noqa: E402

_row_local_interpreter_dot()  # the GPU's row-local dot (see there), not numpy's block matmul
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SEQUENCES = [[5, 9, 300, 7, 11, 2], [1, 2, 3], [400, 17]]


# A dense layer; Qwen3.5's Gated DeltaNet and gated attention layers; DeepSeek-V3's MLA with
# its dense and routed-experts layers; Gemma 3's windowed and global layers.
@pytest.mark.parametrize(
    "source",
    ["random:tiny-qwen3,layers=1", "random:tiny-qwen3.5", "random:tiny-deepseek-v3",
     "random:tiny-gemma3"],
)  # fmt: skip
def test_triton_backend_training_forward_is_the_decoder_bits(source: str) -> None:
    loaded = resolve_model(source)
    triton_ops = GpuDeterministicOps()
    model = LockstepForCausalLM(loaded, torch.float32, torch.device("cpu"), ops=triton_ops)
    out = model(SEQUENCES, return_logits=True)
    decoder = Decoder.load(loaded, triton_ops, torch.float32, "cpu")
    cu = out.cu_seqlens
    assert out.logits is not None
    for b, seq in enumerate(SEQUENCES):
        assert torch.equal(out.logits[cu[b] : cu[b + 1]], decoder.logits_for_sequence(seq))
    # The chunked head (the backend's target log-softmax, no [T, V] log-probabilities) gives
    # the whole log-softmax's entries.
    with torch.no_grad():
        assert torch.equal(model(SEQUENCES).logprobs, out.logprobs)
    # The control: the CPU backend's kernels (another reduction order) give other bits.
    cpu = LockstepForCausalLM.from_pretrained(source)
    cpu_out = cpu(SEQUENCES)
    assert not torch.equal(cpu_out.logprobs, out.logprobs)
    # The backward runs from the Triton forward's saved values; the gradients are the CPU
    # backend's up to the forwards' rounding.
    (-out.logprobs.sum()).backward()
    (-cpu_out.logprobs.sum()).backward()
    params = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        ref = params[name].grad
        if not ref.any():  # an expert no token chose, on either backend
            assert not p.grad.any(), name
            continue
        assert ((p.grad - ref).norm() / ref.norm()).item() < 1e-4, name
