"""The bit-exactness fixture: what every supported model family computes, recorded bit for bit,
so that a refactor of the model code can prove it changed no bit (tests/contract/test_bit_exact_fixture.py).

For each case (every random preset small enough for the CPU, every tiny folder family the tests
write, the embedded default GGUF model) one cold full prefill of a fixed prompt runs on the
deterministic CPU backend in float32. Recorded per case:

    logits_sha256    sha256 of the float32 logits [T, vocab], every position, every bit
    kv_sha256        sha256 of the K/V caches the prefill wrote (and a hybrid model's final
                     linear-attention state): the contract covers the cache too
    logprobs         the float32 log-probability of each next prompt token, as hex of its bits
                     (readable, and says where two recordings first part)
    weights_sha256   folders and GGUF only: sha256 of the checkpoint's tensors as stored, so a
                     changed input (a new transformers drawing tests/support/tiny_hf.py's weights
                     differently) is told apart from a changed decoder

The recording runs in a child process with torch's CPU kernels pinned to AVX2
(ATEN_CPU_CAPABILITY=avx2): torch.randn draws different bits under its AVX2 and AVX-512/default
kernels, and it makes the presets' and tiny folders' weights. Lockstep's own C++ kernels give
the same bits on every SIMD path (docs/cpu_ops.md). The child imports this repository's
lockstep, whatever is installed.

Regenerate (only on code whose bits are meant to change, and say why in the commit):

    python tests/support/bit_exact_fixture.py        # rewrites tests/support/bit_exact_fixture.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.models.decoder import Decoder
from lockstep.models.resolver import LoadedModel, default_model_path, resolve_model
from lockstep.ops import Ops, get_ops
from lockstep.parallel.layers import TensorParallel
from lockstep.parallel.sharding import ShardPlan

TESTS = Path(__file__).resolve().parent  # tests/support
ROOT = TESTS.parents[1]
FIXTURE = TESTS / "bit_exact_fixture.json"
CPU_CAPABILITY = "avx2"
TEXT = "The quick brown fox jumps over the lazy dog; 0123456789."  # 56 bytes: past one chunk
GGUF_TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


@dataclass(frozen=True)
class Case:
    """One recording: the `--model` argument (a folder's is made by `write`), the prompt, and
    the decoder's options that select a different code path (FP8 KV cache, TP reduction)."""

    name: str
    model: str | None
    write: Callable[[Path], Any] | None = None
    kv_dtype: torch.dtype | None = None
    reduction: str | None = None
    text: str = TEXT


def _tiny_folder(family: str) -> Callable[[Path], Any]:
    from tests.support.tiny_hf import save_tiny

    return lambda folder: save_tiny(family, folder)


def _fp8_folder(
    fmt: str, skip: tuple[str, ...] = (), family: str = "qwen3"
) -> Callable[[Path], Any]:
    from tests.support.tiny_fp8 import write_fp8_folder

    return lambda folder: write_fp8_folder(folder, fmt, skip, family)


CASES = (
    Case("random:tiny", "random:tiny"),
    Case("random:tiny-qwen2", "random:tiny-qwen2"),
    Case("random:tiny-qwen3", "random:tiny-qwen3"),
    Case("random:tiny-qwen3 chunked", "random:tiny-qwen3", reduction="chunked"),
    Case("random:tiny-qwen3-moe", "random:tiny-qwen3-moe"),
    Case("random:tiny-qwen3.5", "random:tiny-qwen3.5"),
    Case("random:tiny-qwen3-fp8", "random:tiny-qwen3-fp8"),
    Case("random:tiny-qwen3-fp8 fp8-kv", "random:tiny-qwen3-fp8", kv_dtype=torch.float8_e4m3fn),
    Case("random:tiny-qwen3-fp8-static", "random:tiny-qwen3-fp8-static"),
    Case("random:tiny-qwen3-fp8-channel", "random:tiny-qwen3-fp8-channel"),
    Case("random:tiny-qwen3-moe-fp8", "random:tiny-qwen3-moe-fp8"),
    Case("folder:llama", None, _tiny_folder("llama")),
    Case("folder:qwen2", None, _tiny_folder("qwen2")),
    Case("folder:qwen3", None, _tiny_folder("qwen3")),
    Case("folder:qwen3_moe", None, _tiny_folder("qwen3_moe")),
    Case("folder:qwen3_5", None, _tiny_folder("qwen3_5")),
    Case("folder:fp8-block", None, _fp8_folder("fp8-block")),
    Case("folder:modelopt", None, _fp8_folder("modelopt")),
    Case(
        "folder:compressed-tensors",
        None,
        _fp8_folder("compressed-tensors", ("model.layers.1.mlp.down_proj",)),
    ),
    Case("folder:fp8-block qwen3_moe", None, _fp8_folder("fp8-block", family="qwen3_moe")),
    Case("gguf:default", None, text=GGUF_TEXT),
    Case("random:tiny-gemma3", "random:tiny-gemma3"),
    Case("folder:gemma3", None, _tiny_folder("gemma3")),
    Case("random:tiny-deepseek-v3", "random:tiny-deepseek-v3"),
    Case("folder:deepseek_v3", None, _tiny_folder("deepseek_v3")),
    Case("folder:deepseek_v2", None, _tiny_folder("deepseek_v2")),
    Case("folder:glm4_moe_lite", None, _tiny_folder("glm4_moe_lite")),
)


def _sha256(tensors: Iterator[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(str(tensor.dtype).encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(
            tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def _checkpoint_sha256(path: Path) -> str:
    """The stored tensors of a folder (by name) or the bytes of a GGUF file."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(_sha256(iter([tensors[name]])).encode())
    return digest.hexdigest()


def load_case(case: Case, folder: Path) -> tuple[LoadedModel, str | None]:
    """The case's model (a folder case is written to `folder` first) and its checkpoint's
    digest (None for a preset, whose weights are code)."""
    if case.write is not None:
        case.write(folder)
        return resolve_model(str(folder)), _checkpoint_sha256(folder)
    loaded = resolve_model(case.model)
    return loaded, _checkpoint_sha256(default_model_path()) if case.model is None else None


def record(case: Case, loaded: LoadedModel, ops: Ops | None = None) -> dict[str, Any]:
    """One cold full prefill of the case's prompt on `ops` (default: the deterministic CPU
    backend), float32: the digests and next-token logprobs the module docstring lists."""
    ops = ops or get_ops("cpu", "deterministic")
    parallel = None
    if case.reduction is not None:
        parallel = TensorParallel.single(ops, ShardPlan(loaded.spec, 1, 0), case.reduction)
    decoder = Decoder.load(
        loaded, ops, torch.float32, "cpu", parallel=parallel, kv_dtype=case.kv_dtype
    )
    tokens = loaded.tokenizer.encode(case.text)
    logits, kv = decoder.cold_prefill(tokens)
    logprobs = ops.log_softmax(logits)
    picked = logprobs[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    cache = [kv.k, kv.v]
    if kv.linear_state is not None:
        cache += list(kv.linear_state.meaningful())
    return {
        "tokens": len(tokens),
        "logits_sha256": _sha256(iter([logits])),
        "kv_sha256": _sha256(iter(cache)),
        "logprobs": [struct.pack(">f", v).hex() for v in picked.tolist()],
    }


class OneBitFlipped:
    """A weight source with the lowest mantissa bit of one element of one tensor flipped."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def names(self) -> list[str]:
        return self.inner.names()

    def iter(self, dtype: torch.dtype, device: torch.device | str) -> Iterator[Any]:
        for name, tensor in self.inner.iter(dtype, device):
            if name == self.name:
                tensor = tensor.clone()
                tensor.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
            yield name, tensor


FLIPPED = ("model.layers.1.mlp.down_proj.weight", "model.layers.0.linear_attn.A_log")


def _controls() -> dict[str, dict[str, Any]]:
    """What must differ from the recording: the stock backend on random:tiny-qwen3, and
    random:tiny-qwen3.5 with one bit of one weight flipped (`FLIPPED`)."""
    by_name = {case.name: case for case in CASES}
    stock_case, flip_case = by_name["random:tiny-qwen3"], by_name["random:tiny-qwen3.5"]
    loaded, _ = load_case(stock_case, Path())
    out = {"reference mode": record(stock_case, loaded, get_ops("cpu", "reference"))}
    for weight in FLIPPED:
        loaded, _ = load_case(flip_case, Path())
        flipped = dataclasses.replace(loaded, weights=OneBitFlipped(loaded.weights, weight))
        out[f"flipped {weight}"] = record(flip_case, flipped)
    return out


def _record_here() -> dict[str, Any]:
    """Every case and control, in this process (the child of `record_pinned`)."""
    import lockstep

    if Path(lockstep.__file__).resolve().parents[1] != ROOT:
        raise SystemExit(f"imported {lockstep.__file__}, not this repository's lockstep ({ROOT})")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != CPU_CAPABILITY.upper():
        raise SystemExit(
            f"torch runs its {capability} CPU kernels, the recording needs "
            f"ATEN_CPU_CAPABILITY={CPU_CAPABILITY} on a CPU that has it"
        )
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(CASES):
            folder = Path(tmp) / str(index)
            folder.mkdir()
            loaded, weights = load_case(case, folder)
            cases[case.name] = record(case, loaded)
            if weights is not None:
                cases[case.name]["weights_sha256"] = weights
    return {"cases": cases, "controls": _controls()}


def record_pinned() -> dict[str, Any]:
    """`_record_here` in a child process with torch pinned to `CPU_CAPABILITY` and this
    repository's lockstep first on the path; its JSON is the last line of its output."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": CPU_CAPABILITY, "PYTHONPATH": path}
    code = "import json; from tests.support import bit_exact_fixture as f; print(json.dumps(f._record_here()))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"recording failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record_pinned()["cases"], indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(CASES)} cases)", file=sys.stderr)
