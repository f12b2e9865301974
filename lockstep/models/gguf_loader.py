"""Loading a llama-architecture GGUF file: spec, tokenizer and lazily dequantized weights.

The metadata becomes a config.json's keys (`gguf_config`), which the family registry maps to
a spec as it does a Hugging Face folder's.

The metadata is parsed here rather than with `gguf.GGUFReader`: the reader builds a numpy view
per array element, which takes about 1.7 s on the default model's 98,000 vocabulary strings,
a third of the load-time budget; this parser takes under 0.1 s. Tensor data stays memory-mapped
and is dequantized one tensor at a time by `gguf.quants.dequantize`, so the `gguf` package still
defines every block format.

Format quirks are undone here, never in the decoder:
  * llama.cpp's converter permutes the rows of q_proj and k_proj (and their biases) within each
    head, from Hugging Face's rotate-half layout to interleaved pairs; `_unpermute_rows` undoes it.
  * A file without output.weight ties the output projection to the embedding.
  * Llama 3.1+ files store RoPE scaling as a per-frequency factor tensor (rope_freqs.weight);
    it is recognised as Llama 3 scaling and becomes ModelSpec.rope_scaling.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers.models import BPE

from lockstep.errors import ModelLoadError
from lockstep.models.families import family_of
from lockstep.models.spec import ModelSpec, RopeScaling
from lockstep.models.tokenizer import Tokenizer, byte_level_alphabet, chat_stop_token_ids

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_SUPPORTED_QTYPES = frozenset(GGMLQuantizationType[name] for name in SUPPORTED_TYPES)

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, used when general.alignment is absent

# GGUF metadata value types (gguf.GGUFValueType): fixed-size scalars by struct format.
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY_TYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9

# GGUF tensor name -> canonical name (spec.py). {i} is the layer index.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROPE_FREQS = "rope_freqs.weight"

# Split regexes by tokenizer.ggml.pre, as llama.cpp applies them before byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# smollm: every digit on its own, then GPT-2's split (SmolLM's own tokenizer.json does the same).
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


@dataclass(frozen=True)
class _TensorInfo:
    name: str  # as in the file
    shape: tuple[int, ...]  # torch order (ggml lists dimensions fastest-first)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


class GGUFFile:
    """The metadata and tensor table of a GGUF file; tensor bytes are read through mmap."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(f"{path} is not a valid GGUF file ({exc})") from None

    def _parse(self) -> tuple[dict[str, Any], dict[str, _TensorInfo]]:
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (no GGUF magic number)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version}; supported: 2, 3")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = self._value(vtype, pos + 4)
        raw_infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw_infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in raw_infos:
            try:
                kind = GGMLQuantizationType(qtype)
            except ValueError:
                kind = None
            if kind not in _SUPPORTED_QTYPES:
                type_name = kind.name if kind is not None else f"ggml type {qtype}"
                raise ModelLoadError(
                    f"{self.path}: tensor {name} has type {type_name}; supported tensor types: "
                    f"{', '.join(SUPPORTED_TYPES)}"
                )
            block = GGML_QUANT_SIZES[kind][0]
            if not shape or shape[-1] % block:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} has shape {shape}, rows not a multiple of "
                    f"{kind.name}'s block of {block}"
                )
            tensors[name] = _TensorInfo(name, shape, kind, data_start + offset)
        for info in tensors.values():
            if info.offset + info.nbytes > len(buf):
                raise ModelLoadError(f"{self.path} is truncated: tensor {info.name} runs past EOF")
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + length
        return self._map[pos + 8 : end].decode("utf-8"), end

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if item_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item_type])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=pos)
                return values, pos + count * dtype.itemsize
            items = []
            for _ in range(count):
                item, pos = self._value(item_type, pos)
                items.append(item)
            return items, pos
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {vtype}")
        return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (F16/BF16/quantized blocks are dequantized), torch order."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        row_bytes = info.nbytes // math.prod(info.shape[:-1])
        values = dequantize(raw.reshape(*info.shape[:-1], row_bytes), info.qtype)
        return values.reshape(info.shape)


def _unpermute_rows(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation. Within each head of D rows, the converter moved
    Hugging Face row (half i, index j) to row 2*j + i, interleaving the two rotate-half halves:

        HF   [x0 x1 .. x(D/2-1) | y0 y1 .. y(D/2-1)]    GGUF  [x0 y0 x1 y1 .. x(D/2-1) y(D/2-1)]

    so GGUF rows viewed as (head, j, i) are transposed back to (head, i, j)."""
    head_dim = rows.shape[0] // n_heads
    tail = rows.shape[1:]
    return (
        rows.reshape(n_heads, head_dim // 2, 2, *tail)
        .transpose(1, 2)
        .reshape(n_heads * head_dim, *tail)
    )


class GGUFWeights:
    """Canonical-name view of a GGUF file's tensors, dequantized lazily."""

    def __init__(self, file: GGUFFile, spec: ModelSpec) -> None:
        self._file = file
        self._spec = spec
        self._names: dict[str, str] = {}  # canonical -> GGUF name
        for gguf_name in file.tensors:
            if gguf_name == _ROPE_FREQS:
                continue  # folded into spec.rope_scaling by _rope_scaling()
            self._names[_canonical_name(gguf_name, file.path)] = gguf_name

    def names(self) -> list[str]:
        return list(self._names)

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, gguf_name in self._names.items():
            values = self._file.read(gguf_name)
            if not values.flags.writeable:  # F32 data is a view of the read-only map
                values = values.copy()
            tensor = torch.from_numpy(values)
            if ".q_proj." in name:
                tensor = _unpermute_rows(tensor, self._spec.num_heads)
            elif ".k_proj." in name:
                tensor = _unpermute_rows(tensor, self._spec.num_kv_heads)
            target = torch.float32 if name.endswith("norm.weight") else dtype
            yield name, tensor.to(device=device, dtype=target).contiguous()


def _canonical_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(
        f"{path}: tensor {gguf_name} is not part of a llama-architecture model this loader knows"
    )


def _rope_scaling(file: GGUFFile, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama 3 scaling from rope_freqs.weight, the per-frequency divisors llama.cpp's converter
    writes for rope_type llama3. The file keeps only the divisors, so they are matched against
    the llama3 formula with the parameters every Llama 3.x release uses (low 1, high 4,
    original context 8192); the largest divisor is the factor."""
    scaling_type = file.metadata.get("llama.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise ModelLoadError(
            f"{file.path}: llama.rope.scaling.type={scaling_type!r} is not supported; supported: "
            "none, and Llama 3 scaling given by rope_freqs.weight"
        )
    if _ROPE_FREQS not in file.tensors:
        return None
    stored = file.read(_ROPE_FREQS).astype(np.float64)
    candidate = RopeScaling(
        factor=float(stored.max()), low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position=8192,
    )  # fmt: skip
    expected = np.array(llama3_rope_divisors(candidate, head_dim, theta))
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-4):
        raise ModelLoadError(
            f"{file.path}: rope_freqs.weight does not match Llama 3 RoPE scaling; only that "
            "per-frequency scaling is supported"
        )
    return candidate


def llama3_rope_divisors(scaling: RopeScaling, head_dim: int, theta: float) -> list[float]:
    """What each rotary frequency is divided by under Llama 3 scaling: 1 for short wavelengths,
    `factor` for long ones, and a smooth blend between the two bands."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            divisors.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return divisors


def _require(file: GGUFFile, key: str) -> Any:
    if key not in file.metadata:
        raise ModelLoadError(f"{file.path}: metadata key {key} is missing")
    return file.metadata[key]


# The GGUF architectures this loader reads, each with the Hugging Face model_type whose family
# (lockstep/models/families) maps it. Tensor names and the q/k row permutation above are
# llama.cpp's "llama" layout; another architecture needs its own.
GGUF_MODEL_TYPES = {"llama": "llama"}


def gguf_config(file: GGUFFile) -> dict[str, Any]:
    """The file's metadata as the keys of the config.json it was converted from, so that the
    family registry reads a GGUF file as it reads a Hugging Face folder."""
    arch = file.metadata.get("general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise ModelLoadError(
            f"{file.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(map(repr, GGUF_MODEL_TYPES))} (Qwen models load from Hugging Face "
            "folders)"
        )
    experts = int(file.metadata.get(f"{arch}.expert_count", 0))
    if experts:
        raise ModelLoadError(
            f"{file.path}: mixture-of-experts ({arch}.expert_count={experts}) is not supported; "
            f"supported: dense {arch} models"
        )
    meta = file.metadata
    hidden = int(_require(file, f"{arch}.embedding_length"))
    heads = int(_require(file, f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = file.tensors.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size") or (embed.shape[0] if embed else len(tokens or ()))
    config = {
        "model_type": GGUF_MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_require(file, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(file, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": theta,
        "rms_norm_eps": float(_require(file, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
    }
    scaling = _rope_scaling(file, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        }  # fmt: skip
    return config


def gguf_spec(file: GGUFFile) -> ModelSpec:
    """The file's spec, from its family (`gguf_config`)."""
    config = gguf_config(file)
    where = str(file.path)
    return family_of(config, where).spec(config, where)


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """A byte-level BPE tokenizer from tokenizer.ggml.* (llama.cpp's "gpt2" tokenizer model)."""
    meta = file.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(
            f"{file.path} has no tokenizer (tokenizer.ggml.tokens is missing); supported: GGUF "
            "files with an embedded byte-level BPE tokenizer"
        )
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.model={model!r} is not supported; supported: 'gpt2' "
            "(byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{', '.join(sorted(_PRE_TOKENIZER_SPLITS))}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type")
    if token_types is None:
        token_types = np.ones(len(tokens), dtype=np.int32)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    alphabet = set(byte_level_alphabet().values())
    spell = byte_level_alphabet()
    vocab = {}
    for index, token in enumerate(tokens):
        # Byte-level vocabularies spell every byte with a printable stand-in; a token with other
        # characters (an added token written as plain text) is respelled so the BPE vocabulary
        # stays consistent. Such tokens are matched as added tokens before BPE in any case.
        if not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    try:
        bpe = BPE(vocab, merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # the Rust side raises a bare Exception (e.g. a merge's unknown token)
        raise ModelLoadError(f"{file.path}: inconsistent BPE vocabulary: {exc}") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>) are special: matched whole in input text and
    # dropped by decode(skip_special_tokens=True). User-defined ones are matched whole but kept.
    # A token respelled above is left to BPE: adding its raw text would mint a new id.
    def added(kind: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(tokens[i], special=special, normalized=False)
            for i in np.flatnonzero(token_types == kind)
            if vocab.get(tokens[i]) == i
        ]

    backend.add_special_tokens(added(_CONTROL, special=True))
    backend.add_tokens(added(_USER_DEFINED, special=False))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    template = meta.get("tokenizer.chat_template")
    eos_ids = set() if eos is None else {int(eos)}
    if template is not None:
        eos_ids |= chat_stop_token_ids(backend)
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        eos_token_id=None if eos is None else int(eos),
        # Without the flag, no BOS: what transformers' GGUF tokenizer (the reference) does for
        # byte-level vocabularies.
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=template,
    )


def load_gguf(path: Path) -> tuple[ModelSpec, Tokenizer, GGUFWeights]:
    file = GGUFFile(path)
    spec = gguf_spec(file)
    weights = GGUFWeights(file, spec)
    return spec, gguf_tokenizer(file), weights
