"""A model's own multi-token-prediction (MTP) layers as a drafter's model (docs/speculative.md).

DeepSeek-V3 (`num_nextn_predict_layers`, tensors `model.layers.{num_hidden_layers}.*`) and
Qwen3.5 / Qwen3-Next (`mtp.*`) ship one extra decoder layer trained to predict the token after
next. It reads the target's final-normed hidden state h_t at position t and the embedding of
the token t + 1 that row chose, and predicts token t + 2:

    x      = eh_proj([enorm(embed(token)) ; hnorm(h)])        one linear over 2 * hidden
    y, r   = one decoder layer (the family's own attention and MLP blocks) on x
    logits = head(norm(y + r))                                 the model's LM head (DeepSeek:
                                                               the MTP's shared_head)

and feeds its own y + r back as h for the next draft. Here the layer is a one-layer `Decoder`
of the model's own blocks (the family maps the checkpoint's names to it:
`Family.mtp_tensor_name`), so it runs every backend the model does.

Its attention sees only the positions it drafts in one proposal (a private cache of `limit`
rows, positions 0.. of that window; RoPE is relative, so the window's offset changes no
score), not the MTP layer's keys of the whole context, which would need the layer run over
every position the target computes. That lowers how often a real model's drafts are kept,
never an output: the target decides every token (lockstep/engine/speculative.py). Drafts are
greedy (ties toward the lowest id) and deterministic: a function of the hidden row and the
token, which the contract makes functions of the sequence.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import LayoutEntry, PrepareContext, Step
from lockstep.models.blocks.prepare import prepare_common
from lockstep.models.decoder import Decoder, ScratchKV
from lockstep.models.families import family_of
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.hf_loader import SafetensorsWeights
from lockstep.models.spec import ModelSpec
from lockstep.ops.base import Ops, build_attention_meta

if TYPE_CHECKING:
    from lockstep.models.resolver import LoadedModel

# Canonical names of the MTP's own tensors, beside the one-layer decoder's.
ENORM, HNORM, EH_PROJ = "mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight"


def mtp_spec(spec: ModelSpec) -> ModelSpec:
    """The spec of the MTP layer as a one-layer decoder: the model's full-attention layer (a
    hybrid model's MTP layer is a full-attention one) with its MLP, routed where the model
    has experts (DeepSeek-V3's and the hybrid MoE families' MTP layers are sparse)."""
    moe = None if spec.moe is None else dataclasses.replace(spec.moe, sparse_layers=(0,))
    return dataclasses.replace(spec, num_layers=1, linear=None, moe=moe, fp8=None)


class _SplitWeights:
    """The folder's MTP tensors: the one-layer decoder's stream for `Decoder.load`, the MTP's
    own three tensors set aside as they pass (each tensor is read once)."""

    def __init__(self, weights: SafetensorsWeights) -> None:
        self.weights = weights
        self.own: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        return [n for n in self.weights.names() if not n.startswith("mtp.")]

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights.iter(dtype, device):
            if name.startswith("mtp."):
                self.own[name] = tensor
            else:
                yield name, tensor


class MtpModel:
    """The MTP layer of a loaded model, on the target's device, dtype and backend."""

    def __init__(self, decoder: Decoder, enorm: torch.Tensor, hnorm: torch.Tensor,
                 eh_proj: object) -> None:  # fmt: skip
        self.decoder = decoder
        self.enorm = enorm
        self.hnorm = hnorm
        self.eh_proj = eh_proj

    @classmethod
    def load(
        cls, loaded: LoadedModel, ops: Ops, dtype: torch.dtype, device: torch.device
    ) -> MtpModel:
        """The MTP layer of `loaded` (a Hugging Face folder), strictly loaded; `ModelLoadError`
        names why a model has none this can run."""
        folder = Path(loaded.source)
        where = f"{loaded.name}"
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{where} has no multi-token-prediction layers: MTP drafting "
                                 "needs a Hugging Face folder that ships them")  # fmt: skip
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if config.get("quantization_config"):
            raise ModelLoadError(f"{where}: MTP drafting of an FP8 checkpoint is not supported; "
                                 "supported: bf16/float32 folders")  # fmt: skip
        family = family_of(config, f"{folder}/config.json")
        if family.mtp_tensor_name is None:
            raise ModelLoadError(f"{where}: the {family.name} family has no multi-token-"
                                 "prediction layers; supported: DeepSeek-V3, Qwen3.5, "
                                 "Qwen3.5-MoE, Qwen3-Next")  # fmt: skip
        spec = mtp_spec(loaded.spec)
        layers = loaded.spec.num_layers
        naming = dataclasses.replace(
            family,
            tensor_name=lambda key: family.mtp_tensor_name(key, layers),  # type: ignore[misc]
        )
        weights = SafetensorsWeights(folder, spec, naming, mtp=True)
        own = {n for n in weights.names() if n.startswith("mtp.")}
        if own != {ENORM, HNORM, EH_PROJ}:
            raise ModelLoadError(f"{where} has no multi-token-prediction layers (its folder "
                                 f"holds none of their tensors, e.g. {family.mtp_example})")  # fmt: skip
        from lockstep.models.resolver import LoadedModel

        split = _SplitWeights(weights)
        mtp = LoadedModel(f"{loaded.name} (MTP)", str(folder), spec, loaded.tokenizer, split)
        decoder = Decoder.load(mtp, ops, dtype, device)
        context = PrepareContext(spec, decoder.parallel, dtype, device)
        h = spec.hidden_size
        if tuple(split.own[EH_PROJ].shape) != (h, 2 * h):
            raise ModelLoadError(f"{where}: the MTP projection has shape "
                                 f"{list(split.own[EH_PROJ].shape)}, expected [{h}, {2 * h}]")  # fmt: skip
        norms = [
            prepare_common(LayoutEntry(n, spec.norm_kind, [n]), [split.own[n]], context)
            for n in (ENORM, HNORM)
        ]
        proj = prepare_common(LayoutEntry(EH_PROJ, "linear", [EH_PROJ]), [split.own[EH_PROJ]],
                              context)  # fmt: skip
        return cls(decoder, norms[0], norms[1], proj)

    def draft(self, hidden: torch.Tensor, token: int, limit: int) -> list[int]:
        """`limit` greedy draft tokens after `token`, from `hidden` [hidden_size], the target's
        final-normed row that chose `token`."""
        dec = self.decoder
        ops, spec, eps = dec.ops, dec.spec, dec.spec.rms_norm_eps
        kv = ScratchKV(spec, limit, dec.kv_dtype, dec.device, dec.plan.num_local_kv_heads)
        h = hidden.reshape(1, -1).to(dec.act_dtype)
        drafted: list[int] = []
        for j in range(limit):
            meta = build_attention_meta([1], [j], [list(range(j + 1))])
            batch = ForwardBatch.from_lists([token], [j], [j], meta, [0], None).to(dec.device)
            e = dec.parallel.embed(batch.token_ids, dec.embed).to(dec.act_dtype)
            both = torch.cat(
                [ops.rms_norm(e, self.enorm, eps), ops.rms_norm(h, self.hnorm, eps)], 1
            )
            x = ops.linear(both.contiguous(), self.eh_proj)
            began = {kind: hook.begin(ops, batch) for kind, hook in dec.step_hooks.items()}
            y, residual = dec.run_layer(
                dec.layers[0], x, None, Step(batch, kv, dec.parallel, began)
            )
            normed, h = ops.add_rms_norm(y, residual, dec.final_norm, eps)
            token = int(torch.argmax(dec.head_logits(normed)[0]))  # ties: the lowest id
            drafted.append(token)
        return drafted
