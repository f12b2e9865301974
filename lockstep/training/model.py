"""`LockstepForCausalLM`: a differentiable causal LM whose forward gives the engine's bits.

    model = LockstepForCausalLM.from_pretrained("path/or/hub-id", dtype=torch.bfloat16)
    out = model([[1, 5, 9, 2], [1, 7]])          # a packed batch: any lengths, any order
    out.logprobs                                 # [T]: log P(token j | its sequence before j)

The contract: for the same tokens and weights, in the same mode, dtype and device, every
`logprobs` value equals bit for bit what `LLM.score` and the sampler's logprobs give. It
holds by construction: the forward is the engine decoder's layer loop (lockstep/models/
decoder.py) calling the same `Ops` backend on the same prepared inputs, each op wrapped in an
autograd Function (lockstep/training/functions.py). The deterministic backends are batch
invariant, so where a sequence sits in the packed batch, and what sits beside it, never
changes its bits.

Parameters are `nn.Parameter`s under the Hugging Face names (`state_dict()` keys are what
`save_pretrained` writes and `LLM.update_weights` takes), holding exactly the tensors the
engine loads: norm weights float32, every other tensor in the model dtype (biases are widened
to float32 in the forward, as the engine widens them at load). The engine fuses q|k|v and
gate|up by rows; the forward concatenates the same rows each step, which leaves every output
element's reduction unchanged and keeps the parameters separate.

Supported: the dense families (Llama, Qwen2, Qwen3) and Qwen3-MoE, unquantized, in float32
or bfloat16, on the CPU or CUDA (the backend and activation dtype the engine picks for the
device), with the bits of an engine at tensor-parallel degree 1 (`tp_reduction="ranks"`, its
default) or of an engine at any degree with the chunked reduction (`tp_reduction="chunked"`,
the default at TP > 1). Hybrid (Qwen3.5) models and FP8 checkpoints are refused at load
(docs/training.md says what each lacks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lockstep.errors import ModelLoadError
from lockstep.models.decoder import activation_dtype
from lockstep.models.resolver import LoadedModel, resolve_model
from lockstep.models.rope import rope_tables
from lockstep.models.spec import ModelSpec
from lockstep.models.tokenizer import Tokenizer
from lockstep.ops import build_attention_meta, get_ops
from lockstep.ops.base import AttentionInput, AttentionMeta, Ops
from lockstep.parallel.sharding import chunk_bounds, tree_sum
from lockstep.training import functions as fn

TRAINABLE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MODES = ("deterministic", "fast")
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


@dataclass
class _Batch:
    """One packed batch's layout on the device: token ids, positions, attention metadata."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMeta
    seq_lens: list[int]

    @property
    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.seq_lens:
            cu.append(cu[-1] + n)
        return cu


class LockstepForCausalLM(nn.Module):
    """A dense causal LM with the engine's forward (module docstring). Build it with
    `from_pretrained`; `gradient_checkpointing` recomputes each layer in the backward instead
    of keeping its activations (the recomputation has the same bits: the forward is
    deterministic). `tp_reduction`: the engine reduction of o_proj and down_proj whose bits
    to give (`REDUCTIONS`). `ops`: a backend instead of the engine's for `device` and `mode`
    (tests run the Triton backend on CPU tensors under its interpreter)."""

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
        _refuse_unsupported(spec, loaded.source, dtype, mode)
        if tp_reduction not in REDUCTIONS:
            raise ValueError(
                f"tp_reduction={tp_reduction!r} is invalid: expected one of {REDUCTIONS}"
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
        cos, sin = rope_tables(spec, spec.max_position)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        for name, tensor in loaded.iter_weights(dtype, device):
            _register(self, name, nn.Parameter(tensor.clone()))

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
        whose bits the forward gives ("deterministic", or "fast" for comparisons)."""
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
        prefill from position 0 and sees only its own tokens. `return_routed_experts`: the
        experts this forward routed each row to (`PackedOutput.routed_experts`; a MoE model),
        what a trainer compares with the rollout's or replays."""
        batch = self._pack(sequences, seq_lens)
        routed = None
        if return_routed_experts:
            moe = self.spec.moe
            if moe is None:
                raise ValueError(
                    f"return_routed_experts=True is invalid for {self.spec.family}: it is not a "
                    "mixture-of-experts model"
                )
            t = batch.token_ids.numel()
            routed = torch.zeros((t, self.spec.num_layers, moe.top_k), dtype=torch.int32,
                                 device=batch.token_ids.device)  # fmt: skip
        h = self.get_parameter("model.embed_tokens.weight")[batch.token_ids].to(self.act_dtype)
        residual: torch.Tensor | None = None
        for i in range(self.spec.num_layers):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h, residual = checkpoint(
                    self._layer, i, h, residual, batch, routed, use_reentrant=False
                )
            else:
                h, residual = self._layer(i, h, residual, batch, routed)
        assert residual is not None
        eps = self.spec.rms_norm_eps
        x, _ = fn.add_rms_norm(self.ops, h, residual, self._norm("model.norm.weight"), eps)
        head = "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        logits = fn.linear(self.ops, x, self.get_parameter(head)).float()
        logprobs_all = fn.log_softmax(self.ops, logits)
        out = self._token_logprobs(batch, logprobs_all, logits if return_logits else None)
        out.routed_experts = routed
        return out

    def _layer(
        self, i: int, h: torch.Tensor, residual: torch.Tensor | None, batch: _Batch,
        routed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Layer i as `Decoder.forward` runs it: (norm, attention, norm, MLP), the MLP a
        routed-experts one in a sparse layer (Qwen3-MoE), which writes the experts it routed
        each row to into `routed[:, i]` when given."""
        ops, eps, p = self.ops, self.spec.rms_norm_eps, f"model.layers.{i}."
        input_norm = self._norm(p + "input_layernorm.weight")
        if residual is None:
            residual = h
            x = fn.rms_norm(ops, h, input_norm, eps)
        else:
            x, residual = fn.add_rms_norm(ops, h, residual, input_norm, eps)
        h = self._attention(p + "self_attn.", x, batch)
        x, residual = fn.add_rms_norm(
            ops, h, residual, self._norm(p + "post_attention_layernorm.weight"), eps
        )
        m = p + "mlp."
        moe = self.spec.moe
        if moe is not None and i in moe.sparse_layers:
            experts = [
                tuple(self.get_parameter(f"{m}experts.{e}.{q}_proj.weight")
                      for q in ("gate", "up", "down"))
                for e in range(moe.num_experts)
            ]  # fmt: skip
            router = self.get_parameter(m + "gate.weight")
            ids = None if routed is None else routed[:, i]
            return fn.moe(ops, x, router, experts, moe.top_k, moe.renormalize, ids), residual
        gate_up = self._cat([m + "gate_proj.weight", m + "up_proj.weight"])
        act = fn.silu_mul(ops, fn.linear(ops, x, gate_up))
        down = self.get_parameter(m + "down_proj.weight")
        return self._row_linear(act, down, 1, self.spec.intermediate_size), residual

    def _attention(self, a: str, x: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """The attention block (lockstep/models/blocks/attention.py) on the packed rows."""
        spec, ops = self.spec, self.ops
        qkv_w = self._cat([a + f"{p}_proj.weight" for p in "qkv"])
        bias = self._cat([a + f"{p}_proj.bias" for p in "qkv"]).float() if spec.qkv_bias else None
        qkv = fn.linear(ops, x, qkv_w, bias)
        q_norm = self._norm(a + "q_norm.weight") if spec.qk_norm else None
        k_norm = self._norm(a + "k_norm.weight") if spec.qk_norm else None
        layer = AttentionInput(
            spec.num_heads, None, None, spec.rms_norm_eps, self.rope_cos, self.rope_sin
        )
        o = fn.causal_attention(
            ops, qkv, q_norm, k_norm, layer, batch.positions, batch.meta, batch.seq_lens,
            self.kv_dtype, 1.0 / math.sqrt(spec.head_dim),
        )  # fmt: skip
        return self._row_linear(o, self.get_parameter(a + "o_proj.weight"), spec.head_dim,
                                spec.num_heads)  # fmt: skip

    def _row_linear(
        self, x: torch.Tensor, weight: torch.Tensor, unit: int, units: int
    ) -> torch.Tensor:
        """o_proj or down_proj (K = `units` heads or columns of `unit` columns each) as
        `TensorParallel.row_linear` computes it at TP 1 under `tp_reduction`."""
        if self.tp_reduction == "ranks":
            return fn.linear(self.ops, x, weight)
        partials = [
            None if lo == hi
            else fn.partial_linear(self.ops, x[:, lo * unit : hi * unit],
                                   weight[:, lo * unit : hi * unit])
            for lo, hi in chunk_bounds(units)
        ]  # fmt: skip
        return tree_sum(partials).to(x.dtype)

    def _norm(self, name: str) -> torch.Tensor:
        return self.get_parameter(name).float()  # the engine keeps norms in float32

    def _cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self.get_parameter(n) for n in names], dim=0)

    def _pack(
        self, sequences: Sequence[Sequence[int]] | torch.Tensor, seq_lens: Sequence[int] | None
    ) -> _Batch:
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
            token_ids = sequences.to(device=device, dtype=torch.int64).reshape(-1)
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
        positions = torch.cat([torch.arange(n) for n in lens])
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        # Slot j of the scratch cache holds row j: sequence b's keys are its own rows.
        slots = [list(range(s, s + n)) for s, n in zip(starts, lens, strict=True)]
        meta = build_attention_meta(lens, [0] * len(lens), slots)
        return _Batch(token_ids.to(device), positions.to(device), meta.to(device), lens)

    def _token_logprobs(
        self, batch: _Batch, logprobs_all: torch.Tensor, logits: torch.Tensor | None
    ) -> PackedOutput:
        """Row j - 1's log-probability of token j, for every j but each sequence's first."""
        t = batch.token_ids.numel()
        cu = batch.cu_seqlens
        device = batch.token_ids.device
        mask = torch.ones(t, dtype=torch.bool, device=device)
        mask[cu[:-1]] = False
        rows = torch.arange(t, device=device).clamp(min=1) - 1
        picked = logprobs_all[rows, batch.token_ids]
        logprobs = torch.where(mask, picked, torch.zeros_like(picked))
        return PackedOutput(logprobs, mask, cu, logits)

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, folder: str | Path) -> None:
        """Write a Hugging Face folder that transformers and Lockstep both load: config.json,
        model.safetensors (this model's `state_dict()`), the tokenizer files (checkpoint.py)."""
        from lockstep.training.checkpoint import save_folder

        save_folder(self, Path(folder))


def _register(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """Place `param` at dotted `name` under `root`, making the modules between, so that
    `state_dict()` and `named_parameters()` use the Hugging Face names."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, param)


def _refuse_unsupported(spec: ModelSpec, source: str, dtype: torch.dtype, mode: str) -> None:
    """One line naming what the training module cannot run (docs/training.md)."""
    if spec.family not in TRAINABLE_FAMILIES:
        raise ModelLoadError(
            f"{source}: family {spec.family!r} has no training forward yet; supported: "
            f"{', '.join(TRAINABLE_FAMILIES)}"
        )
    if spec.fp8 is not None:
        raise ModelLoadError(f"{source}: FP8 checkpoints cannot be trained; load a bf16 one")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is invalid: expected torch.float32 or torch.bfloat16")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
