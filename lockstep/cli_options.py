"""Command-line flags for engine options, shared by every subcommand that starts an engine.

One flag per `EngineConfig` field, generated from the dataclass so a new option cannot be
forgotten; booleans that default to True get a `--no-...` flag, and `bool | None` options
(None: decided by the device) get both `--flag` and `--no-flag`.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Iterable
from typing import Any

from lockstep.config import (
    DEVICES,
    DTYPES,
    GDN_KERNELS,
    KV_DTYPES,
    MODE_ALIASES,
    MODES,
    SPECULATIVE_METHODS,
    TP_REDUCTIONS,
    EngineConfig,
)

_HELP = {
    "model": "Hugging Face hub id (org/name, read from the HF cache or downloaded), GGUF file, "
    "Hugging Face folder or random:PRESET (default: the embedded SmolLM2-135M-Instruct)",
    "revision": "branch, tag or commit of a hub id (default: main)",
    "mode": "deterministic (default) or reference (stock PyTorch/cuBLAS: the negative control "
    "that shows determinism tests can fail, not a speed target; 'fast' is its old name)",
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
    "this many decode-only steps, by a roofline estimate (bounds the longest gap between "
    "streamed tokens; 0: no bound; default: 2 on CUDA where such steps replay piecewise CUDA "
    "graphs, else 0)",
    "enable_prefix_cache": "disable the radix prefix cache",
    "cuda_graphs": "disable CUDA graphs for decode",
    "piecewise_cuda_graphs": "replay steps with prompt rows (up to 1,024 rows) as per-layer CUDA "
    "graphs around eager attention (same bits; models with only paged attention, at tp 1; "
    "default: on with CUDA graphs)",
    "verify_cuda_graphs": "replay speculative verify steps whose sequences verify the same "
    "number of drafts as whole-step CUDA graphs (same bits; models with only paged attention; "
    "default: off)",
    "mla_fused_input": "MLA models on CUDA: RoPE, the latent cache row and the query in two Triton "
    "kernels instead of about 25 torch kernels a layer (same bits; default: off)",
    "num_threads": "CPU threads (default: the cores this process may use, its affinity and "
    'CPU quota; docs/cpu_ops.md, "Threads")',
    "random_seed": "seed of random-weight presets",
    "debug_checks": "check KV cache integrity after every step",
    "tp": "tensor-parallel degree, one process per rank (gloo on the CPU, one GPU per rank on "
    "CUDA); same bits at every degree; which degrees a model takes: docs/design.md",
    "ep": "expert parallelism: 1, or --tp to spread a mixture-of-experts model's experts "
    "over the tensor-parallel ranks (each computes its experts whole; same bits as --tp 1)",
    "tp_reduction": "how row-parallel partial sums are added: chunked (default in deterministic "
    "mode: same bits at every degree), ranks, all_reduce (default in reference mode)",
    "linear_snapshots": "hybrid models: radix snapshots of the linear-attention state to "
    "keep, a pool allocated at start (default: 4 per running request, at most half the memory "
    "the caches get; 0: none)",
    "linear_snapshot_interval": "hybrid models: keep a snapshot every so many tokens besides "
    "prompt ends (a multiple of 32)",
    "enable_return_routed_experts": "MoE models: keep each cached token's routed experts beside "
    "its KV so that requests may ask for them (return_routed_experts, SGLang's routing-replay "
    "field); costs sparse layers x top_k x 2 bytes per KV token",
    "gdn_kernel": "hybrid models: the gated delta rule row after row (recurrent) or in whole "
    "chunk tiles on tensor cores (chunked; other bits, same contract)",
    "speculative": "exact speculative decoding (same outputs): ngram drafts by prompt lookup, "
    "mtp by the model's own multi-token-prediction layer, draft by --draft-model (default: off; docs/speculative.md)",
    "draft_model": "--speculative draft: a small model of the same tokenizer that drafts (a "
    "model argument as --model takes)",
    "num_draft_tokens": "most draft tokens one verify step checks per request",
    "prompt_lookup_min": "shortest n-gram prompt lookup matches",
    "prompt_lookup_max": "longest n-gram prompt lookup matches (tried first)",
    "overlap_decode": "launch the next decode step before this one's tokens reach the host "
    "(same outputs; hides host work on a GPU; default: on for CUDA, off on the CPU)",
}
_CHOICES = {
    "mode": MODES + tuple(MODE_ALIASES),
    "device": DEVICES,
    "dtype": DTYPES,
    "kv_dtype": KV_DTYPES,
    "tp_reduction": TP_REDUCTIONS,
    "gdn_kernel": GDN_KERNELS,
    "speculative": SPECULATIVE_METHODS,
}
_NEGATED = {"enable_prefix_cache": "--no-prefix-cache", "cuda_graphs": "--no-cuda-graphs"}
# The engine options `--help` describes; the others (tuning, debugging, hybrid models, and
# any option not named here) it lists by name only, and `--help-all` describes every one.
COMMON_ENGINE_OPTIONS = (
    "model", "revision", "mode", "device", "dtype", "kv_tokens", "max_model_len",
    "num_threads", "tp",
)  # fmt: skip
MORE_ENGINE_OPTIONS = "more engine options"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, adding "(default: X)" to every option that takes a value and
    has one, unless its help already speaks of its default. Flags (their default is their
    absence) and options whose absence means "decided at start" (None) show nothing.

    Brief unless `full`: the "more engine options" group is one line of flag names, and
    the usage line leaves them out, so that each subcommand's `--help` is about it."""

    full = False

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

    def start_section(self, heading: str | None) -> None:
        self._heading = heading
        super().start_section(heading)

    def add_arguments(self, actions: Iterable[argparse.Action]) -> None:
        if self.full or getattr(self, "_heading", None) != MORE_ENGINE_OPTIONS:
            super().add_arguments(actions)
            return
        flags = ", ".join(a.option_strings[0] for a in actions)
        self.add_text(f"{flags} (--help-all describes them)")

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # Text laid out in lines (an epilog of examples) keeps them; flag names are never
        # cut at their hyphens.
        if "\n" in text.strip():
            return "\n".join(indent + line for line in text.splitlines())
        lines = textwrap.wrap(" ".join(text.split()), width - len(indent), break_on_hyphens=False)
        return "\n".join(indent + line for line in lines)

    def add_usage(self, usage: str | None, actions: Iterable[argparse.Action], *rest: Any) -> None:
        shown = [a for a in actions if self.full or not getattr(a, "more", False)]
        super().add_usage(usage, shown, *rest)


class FullHelpFormatter(DefaultsHelpFormatter):
    full = True


class _HelpAllAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(full_help(parser), end="")
        parser.exit()


def full_help(parser: argparse.ArgumentParser) -> str:
    """`parser`'s help with every engine option described (what `--help-all` prints)."""
    brief = parser.formatter_class
    parser.formatter_class = FullHelpFormatter
    try:
        return parser.format_help()
    finally:
        parser.formatter_class = brief


def use_defaults_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every subcommand's parser under it `DefaultsHelpFormatter`."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_defaults_help(sub)


def add_engine_arguments(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    """One flag per EngineConfig field: the common ones under "engine options", the rest
    under "more engine options" (named only, by `--help`; described by `--help-all`)."""
    common = parser.add_argument_group("engine options")
    more = parser.add_argument_group(MORE_ENGINE_OPTIONS)
    parser.add_argument(
        "--help-all", action=_HelpAllAction, help="show this help with every engine option"
    )
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" and not include_model:
            continue
        group = common if f.name in COMMON_ENGINE_OPTIONS else more
        first = len(group._group_actions)
        _add_engine_argument(group, f)
        for action in group._group_actions[first:]:
            action.more = group is more  # type: ignore[attr-defined]


def _add_engine_argument(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
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
