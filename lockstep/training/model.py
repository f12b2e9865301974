"""`LockstepForCausalLM`: a differentiable causal LM whose forward gives the engine's bits.

    model = LockstepForCausalLM.from_pretrained("path/or/hub-id", dtype=torch.bfloat16)
    out = model([[1, 5, 9, 2], [1, 7]])          # a packed batch: any lengths, any order
    out.logprobs                                 # [T]: log P(token j | its sequence before j)

The contract: for the same tokens and weights, in the same mode, dtype and device, every
`logprobs` value equals bit for bit what `LLM.score` and the sampler's logprobs give. It
holds by construction: the forward IS the engine's decoder (lockstep/models/decoder.py), its
layer loop and its blocks, run on a differentiable view of the same `Ops` backend
(lockstep/training/differentiable_ops.py) over one packed step of cold sequences. The
deterministic backends are batch invariant, so where a sequence sits in the packed batch,
and what sits beside it, never changes its bits. This module has no layer loop of its own.

Parameters are `nn.Parameter`s under the canonical (Hugging Face) names (`state_dict()` keys
are what `LLM.update_weights` takes), holding exactly the tensors the engine loads. The
parameters of a fused linear (q|k|v, gate|up) are rows of one buffer, the fused weight the
decoder reads (training/fused_parameters.py). Each forward prepares the other decoder weights
from the parameters with the blocks' own `prepare` (MLA's absorbed per-head matrices, stacked
experts, norms plus one), as differentiable views, so the gradient reaches every parameter.

Every family the engine serves is trainable (lockstep/models/families), unquantized, in
float32 or bfloat16, on the CPU or CUDA, with the bits of an engine at tensor-parallel degree
1 (`tp_reduction="ranks"`, its default) or of an engine at any degree with the chunked
reduction (`tp_reduction="chunked"`; mixture-of-experts models: "ranks" only). FP8
checkpoints are refused at load.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lockstep.cache.routed_experts import sglang_layout
from lockstep.config import canonical_mode
from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import PrepareContext, Step
from lockstep.models.decoder import Decoder, Layer, ScratchKV, activation_dtype, weight_layout
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.resolver import LoadedModel, resolve_model
from lockstep.models.spec import ModelSpec
from lockstep.models.tokenizer import Tokenizer
from lockstep.ops import build_attention_meta, get_ops
from lockstep.ops.base import Ops
from lockstep.parallel.layers import TensorParallel
from lockstep.parallel.sharding import ShardPlan
from lockstep.training import functions as fn
from lockstep.training.differentiable_ops import DifferentiableOps
from lockstep.training.fused_parameters import fusable, share_rows
from lockstep.training.token_logprobs import token_logprobs

MODES = ("deterministic", "reference")  # lockstep.config.MODES
# Canonical tensors that are constants of the model, not weights to train: DeepSeek-V3's
# routing correction bias (a buffer in transformers too; it moves only the expert choice,
# which has no gradient).
BUFFERS = (".e_score_correction_bias",)
# The engine's row-parallel reductions at TP 1 (lockstep/parallel/layers.py) this module
# reproduces: "ranks", the one-call linear (the TP 1 default), and "chunked", the fixed
# chunks and tree that give every tensor-parallel degree the same bits (the TP > 1 default).
REDUCTIONS = ("ranks", "chunked")


@dataclass
class PackedOutput:
    """One packed forward. `logprobs[j]` (float32 [T]) is log P(token j | the tokens before it
    in its sequence); a sequence's first token has none and holds 0.0 (`mask` is False
    there). `logits` [T, vocab] float32 when asked for: row j predicts token j + 1.
    `cu_seqlens` [B + 1]: sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1.
    `routed_experts` int32 [T, num_hidden_layers, top_k] when asked for (a MoE model): the
    experts row j went to in each sparse layer, dense layers' rows 0 (the engine's layout,
    lockstep/cache/routed_experts.py)."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: list[int]
    logits: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def per_sequence(self) -> list[torch.Tensor]:
        """Each sequence's logprobs of its tokens 1.. (what `LLM.score` gives past None)."""
        cu = self.cu_seqlens
        return [self.logprobs[cu[b] + 1 : cu[b + 1]] for b in range(len(cu) - 1)]

    def routed_experts_per_sequence(self) -> list[torch.Tensor]:
        """Each sequence's routed experts in the rows `/generate` returns for it
        (`meta_info.routed_experts`): positions 0 .. len - 2, every one but the last."""
        if self.routed_experts is None:
            raise ValueError(
                "routed experts were not asked for: forward(return_routed_experts=True)"
            )
        cu = self.cu_seqlens
        return [self.routed_experts[cu[b] : cu[b + 1] - 1] for b in range(len(cu) - 1)]


class _TrainingDecoder(Decoder):
    """The engine's decoder, each layer optionally recomputed in the backward
    (`checkpointing`): the recomputation runs the same ops on the same inputs, so it has
    the same bits. A Gated DeltaNet layer advances its sequences' states in place, so its
    recomputation first puts its slice of every state back to the cold start the step began
    from (training steps are cold prefills)."""

    checkpointing = False

    def run_layer(
        self, layer: Layer, h: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.checkpointing and torch.is_grad_enabled()):
            return super().run_layer(layer, h, residual, step)

        def run(
            h: torch.Tensor, residual: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            with _cold_layer_state(layer, step):
                return Decoder.run_layer(self, layer, h, residual, step)

        return checkpoint(run, h, residual, use_reentrant=False)  # type: ignore[return-value]


@contextmanager
def _cold_layer_state(layer: Layer, step: Step) -> Iterator[None]:
    """Within: a stateful mixer's slice of every sequence's `LinearState` zeroed and its
    position 0, as at the step's start (the step hook advances the positions after the last
    layer, before a recomputation); nothing for a mixer whose cache is the KV pool."""
    states = step.batch.linear_states
    if layer.plan.mixer.cache != "state" or not states:
        yield
        return
    index, positions = layer.mixer.state_index, [state.position for state in states]
    with torch.no_grad():
        for state in states:
            for t in (state.conv, state.recurrent, state.open_k, state.open_gamma, state.open_u,
                      state.open_beta):  # fmt: skip
                t[index].zero_()
            state.position = 0
    try:
        yield
    finally:
        for state, position in zip(states, positions, strict=True):
            state.position = position


class LockstepForCausalLM(nn.Module):
    """A causal LM with the engine's forward (module docstring). Build it with
    `from_pretrained`; `gradient_checkpointing` recomputes each layer in the backward instead
    of keeping its activations. `tp_reduction`: the engine reduction of o_proj and
    down_proj whose bits to give (`REDUCTIONS`). `ops`: a backend instead of the engine's for
    `device` and `mode` (tests run the Triton backend on CPU tensors under its interpreter)."""

    def __init__(
        self,
        loaded: LoadedModel,
        dtype: torch.dtype,
        device: torch.device,
        mode: str = "deterministic",
        gradient_checkpointing: bool = False,
        tp_reduction: str = "ranks",
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        spec = loaded.spec
        mode = canonical_mode(mode)
        _refuse_unsupported(spec, loaded.source, dtype, mode)
        if tp_reduction not in REDUCTIONS:
            raise ValueError(
                f"tp_reduction={tp_reduction!r} is invalid: expected one of {REDUCTIONS}"
            )
        if tp_reduction == "chunked" and spec.moe is not None:
            # The sharded experts' path (lockstep/parallel/experts.py) has no differentiable
            # view yet.
            raise ValueError(
                f"tp_reduction='chunked' is invalid for {loaded.source}: its routed experts "
                "train with the TP 1 reduction only; expected tp_reduction='ranks'"
            )
        self.tp_reduction = tp_reduction
        self.spec: ModelSpec = spec
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.mode = mode
        self.dtype = dtype
        self.device_type = device.type
        # The backend the engine picks for this device and mode (lockstep/engine/engine.py).
        self.ops = ops if ops is not None else get_ops(device.type, mode)
        # The decoder's activation dtype and KV cache dtype (lockstep/models/decoder.py).
        self.act_dtype = activation_dtype(device, dtype)
        self.kv_dtype = dtype
        self.gradient_checkpointing = gradient_checkpointing
        # Rows per chunk of the LM head and log-softmax (None: token_logprobs.CHUNK_ELEMENTS
        # logits per chunk); the bits do not depend on it.
        self.logprob_chunk_rows: int | None = None
        for name, tensor in loaded.iter_weights(dtype, device):
            _register(self, name, tensor.clone())
        # The fused linears' parameters as rows of one buffer each, the decoder's weight
        # (training/fused_parameters.py): a step reads them without concatenating.
        params = dict(self.named_parameters())
        self._fused_rows = {
            entry.target: share_rows(self, entry)
            for entry, _ in weight_layout(spec)
            if fusable(entry, params)
        }

    @classmethod
    def from_pretrained(
        cls,
        model: str | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        mode: str = "deterministic",
        gradient_checkpointing: bool = False,
        tp_reduction: str = "ranks",
        random_seed: int = 0,
        revision: str | None = None,
    ) -> LockstepForCausalLM:
        """Load what `--model` accepts (a Hugging Face folder or hub id, a GGUF file, a
        `random:` preset; None: the embedded default) through Lockstep's own resolver, with
        the tensors the engine would load for `dtype` on `device`. `mode`: the engine mode
        whose bits the forward gives ("deterministic", or "reference", stock torch, for
        comparisons; "fast", its old name, is taken with a deprecation warning)."""
        device = torch.device(device)
        loaded = resolve_model(model, random_seed=random_seed, revision=revision)
        return cls(loaded, dtype, device, mode, gradient_checkpointing, tp_reduction)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        sequences: Sequence[Sequence[int]] | torch.Tensor,
        seq_lens: Sequence[int] | None = None,
        return_logits: bool = False,
        return_routed_experts: bool = False,
    ) -> PackedOutput:
        """Per-token logprobs of a packed batch: `sequences` as lists of token ids, or one
        flat tensor of ids [T] with `seq_lens` (every length >= 1). Each sequence is a cold
        prefill from position 0 and sees only its own tokens: one engine step whose rows are
        every token of every sequence, all of them logit rows. The LM head and log-softmax
        run in chunks of rows (training/token_logprobs.py) unless `return_logits` asks for
        the whole [T, vocab] float32 logits. `return_routed_experts`: the experts this forward
        routed each row to (`PackedOutput.routed_experts`; a MoE model), what a trainer
        compares with the rollout's or replays."""
        if return_routed_experts and self.spec.moe is None:
            raise ValueError(
                f"return_routed_experts=True is invalid for {self.spec.family}: it is not a "
                "mixture-of-experts model"
            )
        host_ids, lens = self._pack(sequences, seq_lens)
        device = self.get_parameter("model.embed_tokens.weight").device
        token_ids = host_ids.to(device)
        decoder = self._decoder(lens)
        t = token_ids.numel()
        cu = [0, *itertools.accumulate(lens)]
        rows = list(range(t))
        positions = [p for n in lens for p in range(n)]
        # Slot j of the scratch cache holds row j: sequence b's keys are its own rows.
        meta = build_attention_meta(lens, [0] * len(lens), [rows[a:b] for a, b in
                                                             itertools.pairwise(cu)])  # fmt: skip
        states = [decoder.new_linear_state() for _ in lens] if self.spec.hybrid else None
        batch = ForwardBatch.from_lists(host_ids.tolist(), positions, rows, meta, rows, states)
        # The MoE blocks write each row's experts into the scratch store at its slot, row j.
        kv = ScratchKV(self.spec, t, self.kv_dtype, device, routed_experts=return_routed_experts)
        x = decoder.hidden_states(batch.to(device), kv)
        logits = None
        if return_logits:
            logits = decoder.head_logits(x)
            picked = fn.log_softmax(self.ops, logits).gather(1, token_ids.roll(-1)[:, None])[:, 0]
        else:  # chunks of rows: no [T, vocab] float32 tensor lives through the backward
            picked = token_logprobs(decoder, x, token_ids.roll(-1), self.logprob_chunk_rows)
        # Row j - 1 predicts token j; each sequence's first token has no logprob (0.0).
        mask = torch.ones(t, dtype=torch.bool, device=device)
        mask[cu[:-1]] = False
        before = torch.arange(t, device=device).clamp(min=1) - 1
        logprobs = torch.where(mask, picked[before], torch.zeros_like(picked))
        routed = None
        if kv.routed_experts is not None:
            routed = torch.from_numpy(sglang_layout(self.spec, kv.routed_experts)).to(device)
        return PackedOutput(logprobs, mask, cu, logits, routed)

    def _decoder(self, lens: list[int]) -> _TrainingDecoder:
        """The engine's decoder over this module's parameters for one packed step of cold
        sequences of `lens` rows: every weight prepared by its block's `prepare`
        (decoder.weight_layout) on the differentiable ops, so each prepared weight is a view
        of parameters autograd follows back. RoPE tables for the longest sequence's
        positions (a table row is a function of its position alone)."""
        spec, device = self.spec, self.get_parameter("model.embed_tokens.weight").device
        ops = DifferentiableOps(self.ops, seq_lens=list(lens))
        parallel = TensorParallel.single(ops, ShardPlan(spec, 1, 0), self.tp_reduction)
        context = PrepareContext(spec, parallel, self.dtype, device)
        params = self.state_dict(keep_vars=True)  # parameters and buffers, as autograd sees them
        parts: dict[str, Any] = {}
        for entry, prepare in weight_layout(spec):
            rows = self._fused_rows.get(entry.target)
            if rows is not None and rows.intact(params):  # the fused weight itself, no copy
                entry, sources = entry._replace(sources=[entry.target]), [rows.weight(params)]
            else:
                sources = [params[n] for n in entry.sources]
            parts[entry.target] = prepare(entry, sources, context)
        decoder = _TrainingDecoder(spec, ops, self.dtype, device, parts, max(lens), parallel,  # type: ignore[arg-type]
                                   self.kv_dtype)  # fmt: skip
        decoder.checkpointing = self.gradient_checkpointing
        return decoder

    def _pack(
        self, sequences: Sequence[Sequence[int]] | torch.Tensor, seq_lens: Sequence[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        """The batch's token ids on the host (int64 [T]) and its lengths, checked."""
        embed = self.get_parameter("model.embed_tokens.weight")
        device = embed.device
        if device.type != self.device_type or embed.dtype != self.dtype:
            # The backend and the activation and cache dtypes were chosen at load.
            raise ValueError(
                f"the model was loaded for {self.device_type} {self.dtype} and now holds "
                f"{device.type} {embed.dtype}: pass device and dtype to from_pretrained "
                "instead of moving the module"
            )
        if isinstance(sequences, torch.Tensor):
            if seq_lens is None:
                raise ValueError("seq_lens=None with a flat tensor of ids: expected the lengths")
            lens = [int(n) for n in seq_lens]
            token_ids = sequences.to(device="cpu", dtype=torch.int64).reshape(-1)
        else:
            if seq_lens is not None:
                raise ValueError("seq_lens is for a flat tensor of ids, not lists of sequences")
            lens = [len(s) for s in sequences]
            token_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
        if not lens or min(lens) < 1 or sum(lens) != token_ids.numel():
            raise ValueError(
                f"seq_lens={lens} do not describe {token_ids.numel()} ids: expected lengths >= 1 "
                "that add up to the number of ids"
            )
        longest = max(lens)
        if longest > self.spec.max_position:
            raise ValueError(
                f"a sequence of {longest} tokens is longer than the model's "
                f"max_position={self.spec.max_position}"
            )
        return token_ids, lens

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, folder: str | Path) -> None:
        """Write a Hugging Face folder that transformers and Lockstep both load: config.json,
        model.safetensors (this model's `state_dict()`), the tokenizer files (checkpoint.py)."""
        from lockstep.training.checkpoint import save_folder

        save_folder(self, Path(folder))


def _register(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Place `tensor` at dotted `name` under `root`, making the modules between, so that
    `state_dict()` uses the canonical names: a parameter, or a buffer for `BUFFERS`."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if name.endswith(BUFFERS):
        module.register_buffer(leaf, tensor)
    else:
        module.register_parameter(leaf, nn.Parameter(tensor))


def _refuse_unsupported(spec: ModelSpec, source: str, dtype: torch.dtype, mode: str) -> None:
    """One line naming what the training module cannot run (docs/training.md)."""
    if spec.fp8 is not None:
        raise ModelLoadError(f"{source}: FP8 checkpoints cannot be trained; load a bf16 one")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is invalid: expected torch.float32 or torch.bfloat16")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
