"""Tokenizer, chat templates and streaming detokenization (no transformers needed here; the
comparison with transformers' tokenizer is in test_hf_reference.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.errors import ModelLoadError, RequestError
from lockstep.models.chat_template import render_chat_template, template_names
from lockstep.models.resolver import resolve_model
from lockstep.models.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return resolve_model(None).tokenizer


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return resolve_model("random:tiny").tokenizer


def test_default_tokenizer_basics(smollm):
    ids = smollm.encode("Hello world")
    assert ids == [19556, 905]  # no BOS: the file says add_bos_token = false
    assert smollm.decode(ids) == "Hello world"
    assert smollm.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert smollm.decode([1, 4093, 2]) == "user"
    assert smollm.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert smollm.is_special(2) and not smollm.is_special(905)
    # the model's own EOS, not the smallest stop id (<|endoftext|> = 0)
    assert smollm.eos_token == "<|im_end|>" and smollm.bos_token == "<|im_start|>"
    # digits are split one by one (tokenizer.ggml.pre = smollm)
    assert smollm.encode("12345") == [33, 34, 35, 36, 37]


def test_default_chat_template(smollm):
    text = smollm.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = smollm.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert smollm.encode_chat([{"role": "user", "content": "Hi"}])[0] == 1


def test_token_str_and_bytes(smollm, byte_tok):
    assert smollm.token_str(905) == " world"
    assert smollm.token_str(2) == "<|im_end|>"
    emoji = smollm.encode("🙂")
    pieces = b"".join(smollm.token_bytes(i) for i in emoji)
    assert pieces == "🙂".encode()
    partial = [i for i in smollm.encode("日本語") if smollm.token_str(i).startswith("bytes:")]
    assert partial and all("\\x" in smollm.token_str(i) for i in partial)
    assert byte_tok.token_str(0xC3) == "bytes:\\xc3"
    assert byte_tok.token_str(ord("a")) == "a"
    assert byte_tok.token_bytes(10**6) == b""


def test_bos_is_added_only_when_asked(byte_tok):
    assert byte_tok.add_bos
    assert byte_tok.encode("a") == [byte_tok.bos_token_id, ord("a")]
    assert byte_tok.encode("a", add_special_tokens=False) == [ord("a")]
    # a chat prompt never gets a second BOS from encode_chat
    assert byte_tok.encode_chat([{"role": "user", "content": "a"}])[0] != byte_tok.bos_token_id


def test_template_features_match_transformers_environment():
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m['content'] | tojson }}\n"
        "{% endfor %}"
        "{% generation %}{{ bos_token }}|{{ eos_token }}{% endgeneration %}"
    )
    msgs = [{"content": "héllo <b>"}, {"content": {"k": [1, 2]}}, {"content": "never"}]
    out = render_chat_template(
        template, msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    # trim_blocks drops the newline after a block tag; tojson keeps non-ASCII and HTML as is
    assert out == '"héllo <b>"\n{"k": [1, 2]}\n<s>|</s>'
    assert (
        render_chat_template(
            "  {% if true %}\nx{% endif %}",
            [],
            add_generation_prompt=False,
            bos_token="",
            eos_token="",
        )
        == "x"
    )  # lstrip_blocks strips the indentation before a block tag


def test_template_names_are_what_it_reads():
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{{ m.role }}{{ m['content'] }}"
        "{% for call in m.tool_calls or [] %}{{ call.function.name }}{% endfor %}"
        "{{ m.get('name', '') }}{% endfor %}"
        "{% if enable_thinking is defined %}{{ raise_exception('no') }}{% endif %}"
    )
    names = template_names(template)
    # Variables from the caller; the environment's own functions (namespace, raise_exception)
    # are not among them.
    assert names.variables == {"messages", "enable_thinking"}
    assert {"role", "content", "tool_calls", "function", "name"} <= names.fields
    assert "tool_call_id" not in names.fields
    assert "name" in template_names("{{ messages[0].get('name') }}").fields


def test_template_errors(byte_tok):
    raising = "{{ raise_exception('system messages are not supported') }}"
    with pytest.raises(RequestError, match="system messages are not supported"):
        render_chat_template(raising, [], add_generation_prompt=True, bos_token="", eos_token="")
    sneaky = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(RequestError):
        render_chat_template(sneaky, [], add_generation_prompt=True, bos_token="", eos_token="")
    with pytest.raises(RequestError, match="failed on these messages"):
        byte_tok.apply_chat_template([{"role": "user"}])  # no content
    with pytest.raises(ModelLoadError, match="does not compile"):
        Tokenizer(
            byte_tok.backend, bos_token_id=None, eos_token_ids=set(), add_bos=False,
            chat_template="{% for x in %}",
        )  # fmt: skip
    bare = Tokenizer(
        byte_tok.backend, bos_token_id=None, eos_token_ids=set(), add_bos=False, chat_template=None
    )
    with pytest.raises(RequestError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def _stream(
    tokenizer: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int]
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    out, i = [], 0
    for size in chunks:
        out.append(detok.push(ids[i : i + size]))
        i += size
    out.append(detok.push(ids[i:]))
    out.append(detok.flush())
    return out


def test_detokenizer_holds_back_incomplete_utf8(byte_tok):
    ids = list("a🙂b".encode())
    detok = IncrementalDetokenizer(byte_tok)
    deltas = [detok.push([i]) for i in ids]
    assert deltas == ["a", "", "", "", "🙂", "b"]
    assert detok.flush() == ""
    cut = IncrementalDetokenizer(byte_tok)
    # ids are the unit: text sharing a push with an unfinished character waits with it
    assert cut.push(list("x🙂".encode())[:3]) == ""
    assert cut.flush() == "x\ufffd"  # U+FFFD: what is left of the unfinished character


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    chunks=st.lists(st.integers(1, 4), max_size=40),
    prompt=st.text(max_size=10),
)
def test_detokenizer_concatenation_equals_decode(smollm, text, chunks, prompt):
    ids = smollm.encode(text)
    prompt_ids = smollm.encode(prompt)
    deltas = _stream(smollm, prompt_ids, ids, chunks)
    assert "".join(deltas) == smollm.decode(ids)
    assert all(not d.endswith("\ufffd") for d in deltas[:-1] if d) or "\ufffd" in text


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 300), max_size=30), chunks=st.lists(st.integers(1, 3)))
def test_detokenizer_on_arbitrary_byte_ids(byte_tok, ids, chunks):
    """Random ids are not valid UTF-8 in general; the stream must still add up to decode()."""
    deltas = _stream(byte_tok, [], ids, chunks)
    assert "".join(deltas) == byte_tok.decode(ids)
