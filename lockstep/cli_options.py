"""Command-line flags for engine options, shared by every subcommand that starts an engine.

One flag per `EngineConfig` field, generated from the dataclass so a new option cannot be
forgotten; booleans that default to True get a `--no-...` flag, and `bool | None` options
(None: decided by the device) get both `--flag` and `--no-flag`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lockstep.config import DEVICES, DTYPES, KV_DTYPES, MODES, TP_REDUCTIONS, EngineConfig

_HELP = {
    "model": "Hugging Face hub id (org/name, read from the HF cache or downloaded), GGUF file, "
    "Hugging Face folder or random:PRESET (default: the embedded SmolLM2-135M-Instruct)",
    "revision": "branch, tag or commit of a hub id (default: main)",
    "mode": "deterministic (default) or fast (plain torch/cuBLAS; the yardstick)",
    "device": "auto, cpu or cuda",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32 or bfloat16",
    "kv_dtype": "KV cache element type: auto (the model dtype) or fp8_e4m3 (one byte per value, "
    "scale 1.0: twice the tokens of a bf16 cache in the same memory)",
    "kv_tokens": "KV pool size in tokens (default: a fraction of free memory)",
    "kv_memory_fraction": "share of memory for the KV pool when --kv-tokens is absent (default: "
    "all the GPU memory left after the weights, the step's workspace, the CUDA graphs and 1 GiB "
    "of headroom; 0.3 of available RAM on the CPU, at most 65536 tokens)",
    "max_model_len": "context limit in tokens (default: the model's)",
    "max_batch_tokens": "tokens per forward step, prefill and decode together (default: 8192 "
    "on CUDA, 1024 on the CPU)",
    "chunk_size": "most prompt tokens one request prefills per step (default: 4096 on CUDA, 512 "
    "on the CPU, at most --max-batch-tokens)",
    "max_running": "most requests running at once (default: 256 on CUDA, 64 on the CPU, at most "
    "--max-batch-tokens)",
    "output_reserve": "share of each running request's remaining max_tokens (at most 4096) that "
    "admission keeps free in the KV pool: 1 admits only what can run to its end without "
    "preemption, 0 admits on the first chunk and preempts when the pool runs dry",
    "max_mixed_step_cost": "a step that carries prefill beside running decodes costs at most "
    "this many decode-only steps, by a roofline estimate (bounds inter-token latency; default: "
    "2 on CUDA, 0 = no bound on the CPU)",
    "enable_prefix_cache": "disable the radix prefix cache",
    "cuda_graphs": "disable CUDA graphs for decode",
    "num_threads": "CPU threads (default: torch's)",
    "random_seed": "seed of random-weight presets",
    "debug_checks": "check KV cache integrity after every step",
    "tp": "tensor-parallel degree, one process per rank (gloo on the CPU, one GPU per rank on "
    "CUDA); same bits at every degree; which degrees a model takes: docs/design.md",
    "tp_reduction": "how row-parallel partial sums are added: chunked (default in deterministic "
    "mode: same bits at every degree), ranks, all_reduce (default in fast mode)",
    "linear_snapshots": "hybrid models: radix snapshots of the linear-attention state to "
    "keep, a pool allocated at start (default: 4 per running request, at most half the memory "
    "the caches get; 0: none)",
    "linear_snapshot_interval": "hybrid models: keep a snapshot every so many tokens besides "
    "prompt ends (a multiple of 32)",
    "overlap_decode": "launch the next decode step before this one's tokens reach the host "
    "(same outputs; hides host work on a GPU; default: on for CUDA, off on the CPU)",
}
_CHOICES = {
    "mode": MODES,
    "device": DEVICES,
    "dtype": DTYPES,
    "kv_dtype": KV_DTYPES,
    "tp_reduction": TP_REDUCTIONS,
}
_NEGATED = {"enable_prefix_cache": "--no-prefix-cache", "cuda_graphs": "--no-cuda-graphs"}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, adding "(default: X)" to every option that takes a value and
    has one, unless its help already speaks of its default. Flags (their default is their
    absence) and options whose absence means "decided at start" (None) show nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or action.default in (None, argparse.SUPPRESS, [], {}, "")
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def use_defaults_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every subcommand's parser under it `DefaultsHelpFormatter`."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_defaults_help(sub)


def add_engine_arguments(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" and not include_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in _NEGATED:
            group.add_argument(
                _NEGATED[f.name], dest=f.name, action="store_false", default=f.default,
                help=_HELP[f.name],
            )  # fmt: skip
        elif f.type == "bool | None":  # --flag / --no-flag, absent: None (auto)
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=_HELP[f.name])  # fmt: skip
        elif f.type in ("bool",) or isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action="store_true", default=f.default,
                               help=_HELP[f.name])  # fmt: skip
        else:
            kind = _arg_type(f)
            group.add_argument(
                flag, dest=f.name, type=kind, default=f.default, choices=_CHOICES.get(f.name),
                help=_HELP[f.name],
            )  # fmt: skip


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig options given on the command line (all fields, defaults included)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if hasattr(args, f.name)
    }


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The command-line words that set `options` (those that differ from their defaults),
    for a result file to record the command that made it."""
    words: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = options.get(f.name, f.default)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in _NEGATED:
            words.append(_NEGATED[f.name])
        elif isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    return words


def _arg_type(f: dataclasses.Field) -> Any:
    text = str(f.type)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str
