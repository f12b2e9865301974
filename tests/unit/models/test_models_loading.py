"""Loaders: GGUF (real default model and synthetic files), Hugging Face folders, random presets,
and the one-line errors for everything unsupported."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

from lockstep.errors import ModelLoadError
from lockstep.models.blocks import expected_weight_names, expected_weight_shape
from lockstep.models.gguf_loader import GGUFFile, _unpermute_rows, llama3_rope_divisors
from lockstep.models.moe import hf_moe_spec
from lockstep.models.presets import (
    CHATML_TEMPLATE,
    PRESETS,
    byte_tokenizer,
)
from lockstep.models.resolver import DEFAULT_MODEL_NAME, default_model_path, resolve_model
from lockstep.models.spec import ModelSpec, RopeScaling
from lockstep.models.tokenizer import byte_level_alphabet

TINY = PRESETS["tiny"].spec


def _permute_like_llama_cpp(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script: Hugging Face row (half i, index j) of each head goes to
    row 2*j + i. Written here independently of the loader's inverse."""
    out = np.empty_like(rows)
    head_dim = rows.shape[0] // n_heads
    half = head_dim // 2
    for h in range(n_heads):
        for i in range(2):
            for j in range(half):
                out[h * head_dim + 2 * j + i] = rows[h * head_dim + i * half + j]
    return out


def _reference_weights(spec: ModelSpec, seed: int = 7) -> dict[str, np.ndarray]:
    """A Hugging Face-layout state dict with non-trivial norms."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(expected_weight_shape(spec, name)).astype(np.float32) * 0.5
        for name in expected_weight_names(spec)
    }


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(name: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def write_tiny_gguf(
    path: Path,
    spec: ModelSpec = TINY,
    qtype: QT = QT.F32,
    arch: str = "llama",
    extra_tensors: dict[str, tuple[np.ndarray, QT]] | None = None,
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
    metadata: dict[str, int] | None = None,
    tokenizer: bool = True,
) -> dict[str, np.ndarray]:
    """A GGUF file as llama.cpp's converter would write it; returns the HF-layout weights that
    a correct loader must reproduce (exactly for F32, up to the quantization otherwise)."""
    weights = _reference_weights(spec)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    alphabet = byte_level_alphabet()
    tokens = [alphabet[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>", "<think>"]
    tokens += ["he", "ll", "hell"]
    tokens += [f"<unused{i}>" for i in range(spec.vocab_size - len(tokens))]
    types = [1] * 256 + [3, 3, 4] + [1] * (spec.vocab_size - 259)
    if tokenizer:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(["h e", "l l", "he ll"])
        writer.add_bos_token_id(256)
        writer.add_eos_token_id(257)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML_TEMPLATE)
    for name, value in weights.items():
        stored = value
        if name.endswith("q_proj.weight"):
            stored = _permute_like_llama_cpp(value, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            stored = _permute_like_llama_cpp(value, spec.num_kv_heads)
        kind = QT.F32 if name.endswith("norm.weight") else qtype
        if kind == QT.F32:
            writer.add_tensor(_gguf_name(name), stored)
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(stored, kind), raw_dtype=kind)
    for name, (value, kind) in (extra_tensors or {}).items():
        writer.add_tensor(name, value, raw_dtype=None if kind == QT.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# ----------------------------------------------------------------------------- default GGUF


@pytest.fixture(scope="module")
def default_model():
    return resolve_model(None)


def test_default_model_spec_and_names(default_model):
    assert default_model.name == DEFAULT_MODEL_NAME
    assert default_model.source == str(default_model_path())
    spec = default_model.spec
    assert (spec.family, spec.num_layers, spec.hidden_size, spec.intermediate_size) == (
        "llama", 30, 576, 1536,
    )  # fmt: skip
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (9, 3, 64, 49152)
    assert spec.rope_theta == 100000.0 and spec.max_position == 8192
    assert spec.tie_word_embeddings and not spec.qkv_bias and not spec.qk_norm
    assert spec.rope_scaling is None
    assert default_model.weight_names() == [
        n for n in default_model.weight_names() if n in set(expected_weight_names(spec))
    ]
    assert sorted(default_model.weight_names()) == sorted(expected_weight_names(spec))
    tok = default_model.tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and not tok.add_bos
    # eos_token_id is <|im_end|> (2); <|endoftext|> (0) is added because the model chats.
    assert tok.eos_token_ids == frozenset({0, 2})


def test_parser_agrees_with_gguf_reader(tmp_path):
    # A synthetic file: GGUFReader takes seconds on the real vocabulary's 98,000 strings.
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=QT.Q4_1)
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        expected = reader.fields[key].contents()
        got = ours.metadata[key]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == expected, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.qtype == t.tensor_type
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        np.testing.assert_array_equal(ours.read(t.name), expected)


def test_default_weights_dtype_device_and_norms(default_model):
    names = []
    for name, tensor in default_model.iter_weights(torch.bfloat16, "cpu"):
        names.append(name)
        if name.endswith("norm.weight"):
            assert tensor.dtype == torch.float32
        else:
            assert tensor.dtype == torch.bfloat16
        assert tensor.is_contiguous() and torch.isfinite(tensor.float()).all()
        if len(names) == 12:
            break
    assert names == default_model.weight_names()[:12]


# ----------------------------------------------------------------------------- synthetic GGUF


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    permuted = torch.from_numpy(_permute_like_llama_cpp(rows, 4))
    np.testing.assert_array_equal(_unpermute_rows(permuted, 4).numpy(), rows)
    bias = np.arange(32, dtype=np.float32)
    restored = _unpermute_rows(torch.from_numpy(_permute_like_llama_cpp(bias, 2)), 2)
    np.testing.assert_array_equal(restored.numpy(), bias)


def test_gguf_f32_round_trip_is_exact(tmp_path):
    path = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(path)
    loaded = resolve_model(str(path))
    assert loaded.name == "tiny" and loaded.spec.family == "llama"
    assert not loaded.spec.tie_word_embeddings
    got = dict(loaded.iter_weights(torch.float32, "cpu"))
    assert list(got) == loaded.weight_names()
    assert set(got) == set(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(got[name].numpy(), value, err_msg=name)


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_gguf_quantized_types_dequantize_and_unpermute(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(path, qtype=qtype)
    got = dict(resolve_model(str(path)).iter_weights(torch.float32, "cpu"))
    spec = TINY
    for name, value in reference.items():
        if name.endswith("norm.weight"):
            np.testing.assert_array_equal(got[name].numpy(), value)
            continue
        stored = value
        heads = {"q_proj": spec.num_heads, "k_proj": spec.num_kv_heads}
        for proj, n in heads.items():
            if proj in name:
                stored = _permute_like_llama_cpp(value, n)
        expected = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype)
        for proj, n in heads.items():
            if proj in name:
                expected = _unpermute_rows(torch.from_numpy(expected), n).numpy()
        np.testing.assert_array_equal(got[name].numpy(), expected, err_msg=name)


def test_gguf_without_output_weight_is_tied(tmp_path):
    spec = ModelSpec(**{**TINY.__dict__, "tie_word_embeddings": True})
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, spec=spec)
    loaded = resolve_model(str(path))
    assert loaded.spec.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weight_names()


def test_gguf_tokenizer_from_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tok = resolve_model(str(path)).tokenizer
    ids = tok.encode("hello<|im_start|><think> 42")
    hell = tok.backend.token_to_id("hell")
    assert ids[:2] == [hell, ord("o")]
    assert ids[2:4] == [256, 258]  # control and user-defined tokens are matched whole
    assert ids[4:] == [ord(" "), ord("4"), ord("2")]
    assert tok.decode(ids) == "hello<think> 42"  # control tokens are skipped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == "hello<|im_start|><think> 42"
    assert tok.eos_token_ids == frozenset({257}) and tok.bos_token_id == 256 and not tok.add_bos
    assert tok.eos_token == "<|im_end|>"


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    )
    spec = ModelSpec(**{**TINY.__dict__, "rope_theta": 500000.0})
    freqs = np.array(llama3_rope_divisors(scaling, spec.head_dim, spec.rope_theta), np.float32)
    assert freqs.min() == 1.0 and freqs.max() == 8.0  # the test covers all three bands
    assert ((freqs > 1.0) & (freqs < 8.0)).any()
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, spec=spec, extra_tensors={"rope_freqs.weight": (freqs, QT.F32)})
    loaded = resolve_model(str(path))
    assert loaded.spec.rope_scaling == scaling
    assert "rope_freqs.weight" not in loaded.weight_names()

    bad = tmp_path / "odd.gguf"
    write_tiny_gguf(bad, spec=spec, extra_tensors={"rope_freqs.weight": (freqs * 1.5, QT.F32)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight does not match Llama 3"):
        resolve_model(str(bad))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


def test_gguf_unsupported_quant_type_names_tensor_type_and_supported(tmp_path):
    path = tmp_path / "q4k.gguf"
    q4k = np.zeros((4, 144), dtype=np.uint8)  # one Q4_K block (256 values) per row
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_extra.weight": (q4k, QT.Q4_K)})
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(path))
    message = _one_line(exc)
    assert "blk.0.attn_extra.weight" in message and "Q4_K" in message
    assert "F32, F16, BF16, Q8_0, Q4_0, Q4_1" in message


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"arch": "qwen2"}, "architecture 'qwen2' is not supported; supported: 'llama'"),
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model='llama' is not supported"),
        ({"pre": "chatglm-bpe"}, "tokenizer.ggml.pre='chatglm-bpe' is not supported"),
        ({"metadata": {"llama.expert_count": 8}}, "mixture-of-experts"),
        ({"tokenizer": False}, "has no tokenizer (tokenizer.ggml.tokens is missing)"),
        (
            {"extra_tensors": {"blk.0.attn_rot.weight": (np.zeros(4, np.float32), QT.F32)}},
            "tensor blk.0.attn_rot.weight is not part of a llama-architecture model",
        ),
    ],
)
def test_gguf_unsupported_files_fail_in_one_line(tmp_path, kwargs, expected):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, **kwargs)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(path))
    assert expected in _one_line(exc)


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(fake))
    assert "not a GGUF file" in _one_line(exc)


# ----------------------------------------------------------------------------- HF folders


def write_hf_folder(
    folder: Path,
    preset: str,
    *,
    config_extra: dict | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    shards: int = 1,
    tokenizer: bool = True,
) -> dict[str, torch.Tensor]:
    spec = PRESETS[preset].spec
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": spec.family,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if spec.moe is not None:  # as Qwen3-MoE configs write it (dense layers by mlp_only_layers)
        config.update(
            num_experts=spec.moe.num_experts,
            num_experts_per_tok=spec.moe.top_k,
            moe_intermediate_size=spec.moe.intermediate_size,
            norm_topk_prob=spec.moe.renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(spec.num_layers) if not spec.is_sparse(i)],
        )
    config.update(config_extra or {})
    (folder / "config.json").write_text(json.dumps(config))
    weights = dict(resolve_model(f"random:{preset}", 5).iter_weights(torch.float32, "cpu"))
    weights = {n: t.to(torch.bfloat16) for n, t in weights.items()}
    weights.update(extra_tensors or {})
    names = list(weights)
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::shards]}
            save_file(part, str(folder / file_name))
            weight_map.update({n: file_name for n in part})
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if tokenizer:
        byte_tokenizer(spec.vocab_size, add_bos=False).backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {"eos_token": "<|eos|>", "bos_token": None, "chat_template": CHATML_TEMPLATE}
            )
        )
    return weights


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_round_trip(tmp_path, preset, shards):
    folder = tmp_path / "my-model"
    reference = write_hf_folder(folder, preset, shards=shards)
    loaded = resolve_model(str(folder))
    assert loaded.name == "my-model" and loaded.source == str(folder)
    assert loaded.spec == PRESETS[preset].spec
    assert sorted(loaded.weight_names()) == sorted(reference)
    got = dict(loaded.iter_weights(torch.bfloat16, "cpu"))
    assert list(got) == loaded.weight_names()
    for name, value in reference.items():
        expected_dtype = torch.float32 if name.endswith("norm.weight") else torch.bfloat16
        assert got[name].dtype == expected_dtype
        assert torch.equal(got[name].to(torch.bfloat16), value), name
    tok = loaded.tokenizer
    assert tok.chat_template == CHATML_TEMPLATE and not tok.add_bos and tok.bos_token_id is None
    assert tok.eos_token_ids == frozenset({257, 259})  # <|eos|>, and <|im_end|> for chat
    assert tok.eos_token == "<|eos|>"


def test_hf_folder_skips_inv_freq_and_tied_lm_head(tmp_path):
    folder = tmp_path / "m"
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "lm_head.weight": torch.zeros(512, 128),
    }
    write_hf_folder(folder, "tiny-qwen2", extra_tensors=extra)
    names = resolve_model(str(folder)).weight_names()
    assert not any("inv_freq" in n for n in names) and "lm_head.weight" not in names


def test_hf_folder_unexpected_tensor_is_refused(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(
        folder, "tiny", extra_tensors={"model.layers.0.self_attn.o_proj.bias": torch.ones(128)}
    )
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert "1 unexpected tensors (e.g. model.layers.0.self_attn.o_proj.bias)" in _one_line(exc)


def test_hf_folder_rope_parameters_llama3(tmp_path):
    folder = tmp_path / "m"
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    write_hf_folder(folder, "tiny", config_extra={"rope_parameters": rope})
    spec = resolve_model(str(folder)).spec
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "config_extra, expected",
    [
        (
            {"model_type": "gpt_oss"},
            "model_type 'gpt_oss' is not supported; supported: llama, mistral, ministral, phi3, qwen2",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn' is not supported",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq' is not"),
    ],
)
def test_hf_folder_unsupported_configs(tmp_path, config_extra, expected):
    folder = tmp_path / "m"
    write_hf_folder(folder, "tiny", config_extra=config_extra)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert expected in _one_line(exc)


@pytest.mark.parametrize(
    "config_extra, expected",
    [
        ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size=512 (a shared "
         "expert) is not supported"),
        ({"n_shared_experts": 1}, "n_shared_experts=1 (a shared expert) is not supported"),
        ({"n_group": 8, "topk_group": 4}, "n_group=8 (grouped top-k routing) is not supported"),
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' (a router scoring function)"),
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' (a top-k method other than greedy)"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 (a routed scaling factor)"),
        # A deepseek_v3 config is read by the DeepSeek family: without MLA keys it is refused.
        ({"model_type": "deepseek_v3", "n_shared_experts": 1}, "required key kv_lora_rank"),
        ({"num_experts_per_tok": 9}, "inconsistent experts: num_experts_per_tok=9 must be"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0; a qwen3_moe config needs"),
    ],
)  # fmt: skip
def test_hf_folder_unsupported_moe_features_are_refused_in_one_line(
    tmp_path, config_extra, expected
):
    folder = tmp_path / "m"
    write_hf_folder(folder, "tiny-qwen3-moe", config_extra=config_extra)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert expected in _one_line(exc)


def test_hf_folder_moe_layers_and_expert_count_keys(tmp_path):
    """transformers 5 saves num_experts as num_local_experts; decoder_sparse_step and
    mlp_only_layers place the sparse layers as transformers does."""
    folder = tmp_path / "m"
    write_hf_folder(folder, "tiny-qwen3-moe")
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts"] = config.pop("num_experts")
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(folder)).spec == PRESETS["tiny-qwen3-moe"].spec
    spec = PRESETS["tiny-qwen3-moe"].spec
    config = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    for extra, sparse in (
        ({}, (0, 1, 2, 3, 4, 5)),
        ({"decoder_sparse_step": 2}, (1, 3, 5)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1, 5)),
        ({"mlp_only_layers": [0, 4]}, (1, 2, 3, 5)),
    ):
        assert hf_moe_spec({**config, **extra}, 6, "c").sparse_layers == sparse, extra
    del config["moe_intermediate_size"]
    with pytest.raises(ModelLoadError, match="required key moe_intermediate_size is missing"):
        hf_moe_spec(config, spec.num_layers, "c")


def test_hf_folder_moe_shared_expert_tensor_is_refused(tmp_path):
    folder = tmp_path / "m"
    extra = {"model.layers.0.mlp.shared_expert.gate_proj.weight": torch.ones(64, 128)}
    write_hf_folder(folder, "tiny-qwen3-moe", extra_tensors=extra)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert "1 unexpected tensors (e.g. model.layers.0.mlp.shared_expert.gate_proj" in _one_line(exc)


def test_hf_folder_config_without_required_key(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, "tiny")
    config = json.loads((folder / "config.json").read_text())
    del config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert "required key num_attention_heads is missing" in _one_line(exc)


def test_hf_folder_missing_pieces(tmp_path):
    folder = tmp_path / "no-tokenizer"
    write_hf_folder(folder, "tiny", tokenizer=False)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert f"{folder} has no tokenizer.json" in _one_line(exc)

    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(folder))
    assert f"{folder} has no config.json" in _one_line(exc)

    weights_only = tmp_path / "no-weights"
    write_hf_folder(weights_only, "tiny")
    (weights_only / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(weights_only))
    assert "has no *.safetensors weights" in _one_line(exc)


# ----------------------------------------------------------------------------- presets


def test_preset_weights_are_reproducible_and_order_independent():
    first = resolve_model("random:tiny-qwen3", random_seed=3)
    a = dict(first.iter_weights(torch.float32, "cpu"))
    second = resolve_model("random:tiny-qwen3", random_seed=3)
    names = second.weight_names()
    for name in reversed(names):  # any order, one tensor at a time
        assert torch.equal(second.weights.tensor(name, torch.float32, "cpu"), a[name])
    other = dict(
        resolve_model("random:tiny-qwen3", random_seed=4).iter_weights(torch.float32, "cpu")
    )
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.weight"],
                           a["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    bf16 = dict(first.iter_weights(torch.bfloat16, "cpu"))
    assert torch.equal(bf16["lm_head.weight"], a["lm_head.weight"].to(torch.bfloat16))


def test_a_preset_cut_to_its_first_layers_keeps_their_tensors():
    whole = dict(resolve_model("random:tiny-qwen3").iter_weights(torch.float32, "cpu"))
    cut = resolve_model("random:tiny-qwen3,layers=1")
    assert cut.spec.num_layers == 1
    weights = dict(cut.iter_weights(torch.float32, "cpu"))
    assert not any(n.startswith("model.layers.1.") for n in weights)
    assert all(torch.equal(t, whole[n]) for n, t in weights.items())
    for bad in ("random:tiny-qwen3,layers=3", "random:tiny-qwen3,layers=0",
                "random:tiny-qwen3,depth=1"):  # fmt: skip
        with pytest.raises(ModelLoadError, match="layers=N with N in 1..2"):
            resolve_model(bad)


# Presets with per-layer fields: a hybrid's layer types, a MoE model's sparse layers, Gemma 3's
# windows, DeepSeek-V3's dense first layer.
@pytest.mark.parametrize(
    "name, layers",
    [("tiny-qwen3.5", 2), ("tiny-qwen3-moe", 1), ("tiny-gemma3", 2), ("tiny-deepseek-v3", 2)],
)
def test_a_per_layer_preset_cut_keeps_its_first_layers_as_they_are(name: str, layers: int):
    whole = resolve_model(f"random:{name}")
    cut = resolve_model(f"random:{name},layers={layers}")
    assert cut.spec.num_layers == layers
    assert cut.spec.layer_plans == whole.spec.layer_plans[:layers]
    tensors = dict(whole.iter_weights(torch.float32, "cpu"))
    weights = dict(cut.iter_weights(torch.float32, "cpu"))
    assert not any(n.startswith(f"model.layers.{layers}.") for n in weights)
    assert all(torch.equal(t, tensors[n]) for n, t in weights.items())


def test_preset_scales_keep_activations_order_one():
    weights = dict(resolve_model("random:tiny-qwen2").iter_weights(torch.float32, "cpu"))
    assert all(
        torch.equal(t, torch.ones_like(t)) for n, t in weights.items() if n.endswith("norm.weight")
    )
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() * 128**0.5 - 1.0) < 0.05
    x = torch.randn(256, 128)
    assert 0.8 < (x @ q.T).std().item() < 1.2
    assert abs(weights["model.embed_tokens.weight"].std().item() - 0.02) < 0.002


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_have_real_shapes(preset):
    loaded = resolve_model(f"random:{preset}")
    spec = loaded.spec
    assert loaded.name == f"random:{preset}" and loaded.source == preset
    assert loaded.weight_names() == expected_weight_names(spec)
    total = sum(int(np.prod(expected_weight_shape(spec, n))) for n in loaded.weight_names())
    extras = sum(
        int(np.prod(expected_weight_shape(spec, n)))
        for n in loaded.weight_names()
        if n.endswith((".bias", "_scale", ".e_score_correction_bias"))
        or "q_norm" in n
        or "k_norm" in n
    )  # FP8 scales, like biases (routers' too) and q/k norms, are not counted as parameters
    assert total - extras == spec.num_parameters
    assert loaded.tokenizer.vocab_size == spec.vocab_size


def test_named_preset_shapes():
    qwen3 = PRESETS["qwen3-8b"].spec
    assert round(qwen3.num_parameters / 1e9, 2) == 8.19 and qwen3.qk_norm
    qwen3_moe = PRESETS["qwen3-30b-a3b"].spec
    assert round(qwen3_moe.num_parameters / 1e9, 2) == 30.53 and qwen3_moe.qk_norm
    llama3 = PRESETS["llama3-8b"].spec
    assert llama3.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert round(llama3.num_parameters / 1e9, 2) == 8.03
    # Llama 3.1 70B's published count, exactly; Qwen3-32B's 32.8 B.
    assert PRESETS["llama3-70b"].spec.num_parameters == 70_553_706_496
    assert PRESETS["llama3-70b"].spec.rope_scaling == llama3.rope_scaling
    assert round(PRESETS["qwen3-32b"].spec.num_parameters / 1e9, 1) == 32.8
    assert PRESETS["qwen2-0.5b"].spec.qkv_bias and PRESETS["tiny-qwen2"].spec.qkv_bias
    assert PRESETS["tiny-qwen3"].spec.qk_norm and not PRESETS["tiny"].spec.qk_norm


def test_preset_tokenizer_round_trips_text():
    tok = resolve_model("random:tiny").tokenizer
    text = "héllo wörld 🙂\n\tcode: x = [1, 2]"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.add_bos
    assert ids[1:] == list(text.encode())
    assert tok.decode(ids) == text
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode([300]) == "<|unused_300|>"


# ----------------------------------------------------------------------------- resolver errors


@pytest.mark.parametrize(
    "model, expected",
    [
        ("random:nope", "unknown preset random:nope; presets: random:tiny,"),
        ("/no/such/path", "--model '/no/such/path' does not exist; supported: a .gguf file"),
    ],
)
def test_resolver_errors_are_one_line(model, expected):
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(model)
    assert expected in _one_line(exc)


def test_a_missing_model_is_a_short_line_that_points_to_the_presets():
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("/no/such/path")
    line = _one_line(exc)
    assert len(line) < 400 and "random:tiny" in line and '"Random presets"' in line
    assert "random:qwen3-8b" not in line  # the control: the presets are not listed one by one


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(tmp_path))
    assert "has no config.json" in _one_line(exc)


def test_plain_file_is_refused(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(str(other))
    assert "is not a .gguf file" in _one_line(exc)


def test_hf_tokenizer_bos_from_post_processor_and_eos_union(tmp_path):
    from tokenizers import processors

    folder = tmp_path / "llama3-like"
    write_hf_folder(folder, "tiny")
    backend = byte_tokenizer(512, add_bos=False).backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 256)]
    )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}})
    )
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 300]}))
    tok = resolve_model(str(folder)).tokenizer
    assert tok.add_bos and tok.encode("a") == [256, ord("a")]  # no flag: the post-processor
    assert tok.encode("a", add_special_tokens=False) == [ord("a")]
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.eos_token_ids == frozenset({257, 259, 300}) and tok.eos_token == "<|eos|>"

    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "add_bos_token": False, "eos_token": "<|eos|>"})
    )
    assert not resolve_model(str(folder)).tokenizer.add_bos  # an explicit flag wins


def test_hf_named_chat_templates(tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, "tiny")
    templates = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": CHATML_TEMPLATE},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert resolve_model(str(folder)).tokenizer.chat_template == CHATML_TEMPLATE


def test_engine_runs_without_the_gguf_package():
    """The GPU image has no gguf: the engine (random presets, HF folders) must import and run
    without it, and only a GGUF file asks for it. A fresh process with gguf made unimportable."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['gguf'] = None\n"
        "from lockstep.config import EngineConfig\n"
        "from lockstep.engine.engine import Engine\n"
        "from lockstep.engine.sampling_params import SamplingParams\n"
        "e = Engine(EngineConfig(model='random:tiny', kv_tokens=256))\n"
        "e.add_request('r', [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))\n"
        "while e.has_unfinished(): e.step()\n"
        "import lockstep.models.gguf_loader\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    # Lines 1-7 (the engine, a generation) ran; line 8, importing the GGUF loader, is the first
    # to need gguf, and it fails: so gguf really was missing (the control).
    assert out.returncode != 0, "gguf was importable after all: the test proves nothing"
    assert 'File "<string>", line 8' in out.stderr, out.stderr
    assert "gguf" in out.stderr.splitlines()[-1]
