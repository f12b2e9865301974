"""Lockstep against Hugging Face transformers, the reference implementation.

(a) The default GGUF, loaded by transformers from the same file: identical weights, prompt
    logprobs within 1e-3, the same greedy continuations, and Paris.
(b) Tiny random Llama, Qwen2, Qwen3 and Qwen3-MoE models built in transformers and saved as
    folders: resolve_model + Decoder give the same float32 logits within 1e-5.
(c) Tokenization and chat-template rendering (continue_final_message too) equal
    transformers' for the default GGUF.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lockstep.engine.llm import LLM  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.resolver import default_model_path, resolve_model  # noqa: E402
from lockstep.models.tokenizer import Tokenizer  # noqa: E402
from lockstep.ops import get_ops  # noqa: E402
from tests.support.tiny_hf import save_tiny  # noqa: E402

LONG_TEXT = " ".join(
    [
        "The history of computing spans several centuries, from mechanical calculators built",
        "by Pascal and Leibniz to the programmable looms of Jacquard and the analytical engine",
        "that Babbage designed but never finished. Ada Lovelace wrote what many consider the",
        "first algorithm intended for such a machine. In the twentieth century, electronic",
        "computers replaced relays with vacuum tubes and later transistors; integrated circuits",
        "then put thousands, and eventually billions, of transistors on a single chip.",
    ]
    * 3
)
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Write a Python function that adds two numbers."},
    ],
]
RAW_PROMPTS = ["The quick brown fox jumps over the lazy dog. Once upon a time,", LONG_TEXT]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def llm():
    return LLM(None, kv_tokens=4096)


def _prompt_ids(tokenizer, prompt) -> list[int]:
    return tokenizer.encode_chat(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


def _hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ----------------------------------------------------------------------------- (a)


def test_weights_equal_transformers_gguf_loading(hf_model):
    ours = resolve_model(None)
    reference = hf_model.state_dict()
    for name, tensor in ours.iter_weights(torch.float32, "cpu"):
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])


@pytest.mark.parametrize("prompt", CHAT_PROMPTS + RAW_PROMPTS, ids=["chat", "chat2", "raw", "long"])
def test_prompt_logprobs_match_transformers(llm, hf_model, prompt):
    ids = _prompt_ids(llm.tokenizer, prompt)
    if prompt is LONG_TEXT:
        assert len(ids) > 200
    ours = torch.log_softmax(llm.engine.decoder.logits_for_sequence(ids), dim=-1)
    ref = _hf_token_logprobs(hf_model, ids)
    targets = torch.tensor(ids[1:])
    positions = torch.arange(len(ids) - 1)
    token_delta = (ours[positions, targets] - ref[positions, targets]).abs().max().item()
    assert token_delta < 1e-3, f"max |delta logprob| of prompt tokens = {token_delta:.2e}"


def test_greedy_continuations_match_transformers(llm, hf_model):
    """Our greedy continuation is transformers' greedy continuation iff, fed the same tokens,
    transformers' argmax at every generated position is the token we chose (by induction
    over positions); one teacher-forced forward checks that, instead of 32 slow generate steps."""
    prompts = [_prompt_ids(llm.tokenizer, p) for p in CHAT_PROMPTS + RAW_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    eos = llm.tokenizer.eos_token_ids
    for ids, out in zip(prompts, outputs, strict=True):
        generated = list(out.token_ids)
        assert len(generated) == GREEDY_TOKENS or generated[-1] in eos
        ref = _hf_token_logprobs(hf_model, ids + generated)
        hf_choice = ref[len(ids) - 1 : len(ids) - 1 + len(generated)].argmax(dim=-1).tolist()
        assert hf_choice == generated, llm.tokenizer.decode(ids)


def test_capital_of_france(llm):
    out = llm.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS))
    assert out.text == "The capital of France is Paris."


# ----------------------------------------------------------------------------- (b)


def _assert_logits_match(model, decoder, label: str) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (150,), generator=generator).tolist()
    ours = decoder.logits_for_sequence(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    delta = (ours - ref).abs()
    # transformers computes RoPE angles position * inv_freq in float32 (also in float64 mode),
    # an error that grows with the position (~1e-5 rad at 150); Lockstep's tables are float64.
    # Hence 1e-5 over the first 64 positions and a looser bound over the rest.
    early, late = delta[:64].max().item(), delta.max().item()
    assert early < 1e-5, f"{label}: max |delta logit| over positions 0-63 = {early:.2e}"
    assert late < 3e-5, f"{label}: max |delta logit| over positions 0-149 = {late:.2e}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_transformers(tmp_path, family):
    model = save_tiny(family, tmp_path / family)
    loaded = resolve_model(str(tmp_path / family))
    assert loaded.spec.family == family
    assert (loaded.spec.rope_scaling is not None) == (family == "llama")
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    _assert_logits_match(model, decoder, family)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False}],
    ids=["step1-mlp_only2-renormalized", "step2-not_renormalized"],
)
def test_tiny_qwen3_moe_matches_transformers(tmp_path, overrides):
    """8 experts, top 2, dense and sparse layers as transformers places them, with and without
    norm_topk_prob."""
    model = save_tiny("qwen3_moe", tmp_path / "moe", **overrides)
    loaded = resolve_model(str(tmp_path / "moe"))
    moe = loaded.spec.moe
    assert loaded.spec.family == "qwen3_moe" and moe is not None
    hf_sparse = tuple(
        i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")
    )
    assert moe.sparse_layers == hf_sparse and 0 < len(hf_sparse) < 4  # both kinds of layer
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 40)
    assert moe.renormalize == model.config.norm_topk_prob
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    _assert_logits_match(model, decoder, f"qwen3_moe {overrides}")


# ----------------------------------------------------------------------------- (c)

TOKENIZER_STRINGS = [
    "Hello world",
    "  leading and  double  spaces\tand tabs\n\n\nnewlines  ",
    "Numbers: 3.14159, 1,000,000 and 2024-06-30T12:00:00Z; 12345678901234567890",
    "Unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "Emoji 🙂🚀👍🏽 and combining e\u0301 and zero\u200bwidth",
    "def add(a, b):\n    return a + b  # comment\n\nprint(add(1, 2))\n",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine; you've seen what we'd do. DON'T SHOUT",
    "<|endoftext|><repo_name>lockstep<file_sep>main.py\n",
    "",
    " ",
    "a" * 300,
]


@pytest.mark.parametrize("text", TOKENIZER_STRINGS, ids=range(len(TOKENIZER_STRINGS)))
def test_tokenization_matches_transformers(llm, hf_tokenizer, text):
    ours = llm.tokenizer
    assert (ours.bos_token, ours.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    expected = hf_tokenizer(text, add_special_tokens=True).input_ids
    assert ours.encode(text) == expected
    assert ours.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert ours.decode(expected, skip_special_tokens=False) == hf_tokenizer.decode(expected)


@pytest.mark.parametrize("messages", CHAT_PROMPTS + [[{"role": "user", "content": "ça va? 🙂"}]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(llm, hf_tokenizer, messages, add_generation_prompt):
    ours = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == expected
    assert (
        llm.tokenizer.encode(ours, add_special_tokens=False)
        == hf_tokenizer(expected, add_special_tokens=False).input_ids
    )


# A template that strips each message's content, so the cut must allow for the stripping too.
_TRIMMING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"


@pytest.mark.parametrize("content", ["The capital is", "  spaced out  ", "ends in a line\n"])
@pytest.mark.parametrize("template", ["model", "trimming"])
def test_continue_final_message_cuts_where_transformers_does(hf_tokenizer, content, template):
    """The prompt ends inside the final message, exactly where transformers ends it."""
    ours = resolve_model(None).tokenizer
    if template == "trimming":
        ours = Tokenizer(
            ours.backend, bos_token_id=ours.bos_token_id, eos_token_ids=ours.eos_token_ids,
            add_bos=ours.add_bos, chat_template=_TRIMMING_TEMPLATE,
        )  # fmt: skip
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend)
    reference.chat_template = ours.chat_template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ours.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    whole = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert whole.startswith(got) and len(whole) > len(got)  # the end of turn is gone
