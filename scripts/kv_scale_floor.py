"""The checkpoint-scaled FP8 KV cache against its float64 emulation, beside the bf16 floor: the
figures behind tests/support/kv_scale_accuracy.py's bounds.

    python scripts/kv_scale_floor.py [--formats modelopt compressed-tensors] [--prompts 6]

On a GPU the deterministic backend runs compiled; without one, the same Triton kernels run
under the interpreter on the CPU (bf16 activations, the tests' row-local interpreter dot).
Per format (tests/support/tiny_fp8_kv.py's folders): the RMS logit error of the bf16 decoder
with a bf16 cache against the float64 model with an exact cache (floor), of the FP8 cache at
the checkpoint's scales against the float64 emulation (scaled), and at scale 1.0 (unscaled),
over TOKENS and seeded 24-token prompts; and the largest |error| over TOKENS alone, scaled and
unscaled. Then where the floor comes from, without Lockstep: the largest change of TOKENS'
float64 logits when every module output is rounded to bf16, for the folder's float model, its
quantized model (FP8 projections) and that with the FP8 cache emulated. A table each, then one
JSON document on the last line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bf16_module_rounding(model: Any, tokens: list[int]) -> float:
    """Largest |change| of a float64 model's logits when every module output is rounded to
    bf16 (forward hooks; rotary tables excepted, which Lockstep keeps in float32)."""

    def round_output(module: Any, inputs: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out.to(torch.bfloat16).to(out.dtype)
        if isinstance(out, tuple):
            return tuple(o.to(torch.bfloat16).to(o.dtype) if torch.is_tensor(o)
                         and o.is_floating_point() else o for o in out)  # fmt: skip
        return None

    with torch.no_grad():
        exact = model(torch.tensor([tokens])).logits[0]
        hooks = [m.register_forward_hook(round_output) for name, m in model.named_modules()
                 if name and "rotary" not in name]  # fmt: skip
        rounded = model(torch.tensor([tokens])).logits[0]
    for hook in hooks:
        hook.remove()
    return float((rounded - exact).abs().max())


def errors(loaded: Any, spec: Any, kv_dtype: torch.dtype, token_lists: list[list[int]],
           want: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The bf16 deterministic decoder's logits over every prompt minus `want`."""
    from lockstep.models.decoder import Decoder
    from lockstep.ops import get_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    decoder = Decoder.load(dataclasses.replace(loaded, spec=spec), get_ops("cuda", "deterministic"),
                           torch.bfloat16, device, kv_dtype=kv_dtype)  # fmt: skip
    decoder.act_dtype = torch.bfloat16  # a CPU decoder's default is float32
    return torch.cat([decoder.logits_for_sequence(t).double().cpu() for t in token_lists]) - want


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["modelopt", "compressed-tensors"])
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu:  # the interpreter's tl.dot as the kernel tests run it (bf16 held as bits)
        sys.path.insert(0, str(ROOT / "tests" / "kernels"))
        from test_ops_triton import _row_local_interpreter_dot

        _row_local_interpreter_dot()

    from lockstep.models.resolver import resolve_model
    from tests.support.kv_scale_accuracy import TOKENS, float64_logits, prompts
    from tests.support.tiny_fp8 import float64_reference
    from tests.support.tiny_fp8_kv import WEIGHTS, kv_reference, write_kv_scaled_folder

    device = "cuda" if gpu else "cpu"
    token_lists = prompts(args.prompts)
    rows, rounding = [], []
    for fmt in args.formats:
        with tempfile.TemporaryDirectory() as tmp:
            model, scales = write_kv_scaled_folder(Path(tmp), fmt)
            loaded = resolve_model(tmp)
            exact, emulated = float64_logits(model, Path(tmp), fmt, scales, token_lists)

            e4m3 = torch.float8_e4m3fn
            unscaled_spec = dataclasses.replace(loaded.spec, kv_cache_scales=None)
            float_model = copy.deepcopy(model).double()
            float_model.config._attn_implementation = "eager"
            quantized = float64_reference(copy.deepcopy(model), Path(tmp), WEIGHTS[fmt])
            quantized.config._attn_implementation = "eager"
            rounding.append({
                "format": fmt,
                "float": bf16_module_rounding(float_model, TOKENS),
                "fp8_projections": bf16_module_rounding(quantized, TOKENS),
                "fp8_projections_and_cache": bf16_module_rounding(
                    kv_reference(copy.deepcopy(model), Path(tmp), fmt, scales), TOKENS),
            })  # fmt: skip
            diffs = {
                "floor": errors(loaded, loaded.spec, torch.bfloat16, token_lists, exact),
                "scaled": errors(loaded, loaded.spec, e4m3, token_lists, emulated),
                "unscaled": errors(loaded, unscaled_spec, e4m3, token_lists, emulated),
            }
        row = {"format": fmt}
        row |= {k: float(d.pow(2).mean().sqrt()) for k, d in diffs.items()}
        first = len(TOKENS)  # TOKENS' rows come first
        row |= {f"max_{k}_tokens": float(diffs[k][:first].abs().max()) for k in diffs}
        rows.append(row)

    print(f"device: {torch.cuda.get_device_name() if gpu else 'CPU, Triton interpreter'}; "
          f"{len(token_lists)} prompts")  # fmt: skip
    print("| format | RMS floor | RMS scaled (x floor) | RMS unscaled (x floor) | "
          "max scaled / max unscaled, TOKENS |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        f = r["floor"]
        print(f"| {r['format']} | {f:.4f} | {r['scaled']:.4f} ({r['scaled'] / f:.2f}x) | "
              f"{r['unscaled']:.4f} ({r['unscaled'] / f:.2f}x) | {r['max_scaled_tokens']:.3f} / "
              f"{r['max_unscaled_tokens']:.3f} = "
              f"{r['max_scaled_tokens'] / r['max_unscaled_tokens']:.2f} |")  # fmt: skip
    print("\nbf16 rounding at every module output of the float64 models (largest |change|, TOKENS)")
    print("| format | float model | FP8 projections | FP8 projections and cache |")
    print("| --- | --- | --- | --- |")
    for r in rounding:
        print(f"| {r['format']} | {r['float']:.3f} | {r['fp8_projections']:.3f} | "
              f"{r['fp8_projections_and_cache']:.3f} |")  # fmt: skip
    print(json.dumps({"device": device, "prompts": len(token_lists), "rows": rows,
                      "bf16_module_rounding": rounding}))  # fmt: skip


if __name__ == "__main__":
    main()
