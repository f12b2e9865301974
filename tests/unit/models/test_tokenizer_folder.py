"""The Hugging Face tokenizer folder Lockstep writes for models that have none (a GGUF file,
a preset), which routers load (lockstep/models/tokenizer_folder.py): loaded by transformers
it gives Lockstep's own ids, BOS included exactly when Lockstep adds one, and the same chat
prompts; it is written once per content and reused; a Hugging Face folder is its own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lockstep.models.resolver import default_model_path, resolve_model
from lockstep.models.tokenizer_folder import tokenizer_folder

transformers = pytest.importorskip("transformers")

TEXTS = ("Hello world", "  two  spaces\tand émoji 🤖", "line one\nline two")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_a_loader_of_the_folder_gets_locksteps_ids(tmp_path: Path, preset: str) -> None:
    """`tiny` adds BOS, `tiny-qwen3` does not: the folder's post-processor follows."""
    loaded = resolve_model(f"random:{preset}")
    tok = loaded.tokenizer
    folder = tokenizer_folder(tok, loaded.source, 256, tmp_path)
    assert folder is not None
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, False)
    assert (hf.encode("x")[0] == tok.bos_token_id) is tok.add_bos
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered, add_special_tokens=False) == tok.encode_chat(messages)
    assert hf.model_max_length == 256


def test_the_gguf_models_folder(tmp_path: Path) -> None:
    loaded = resolve_model(str(default_model_path()))
    folder = tokenizer_folder(loaded.tokenizer, loaded.source, 8192, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text in (*TEXTS, "<|im_start|>user\nHi<|im_end|>"):
        assert hf.encode(text) == loaded.tokenizer.encode(text)


def test_written_once_and_reused(tmp_path: Path) -> None:
    loaded = resolve_model("random:tiny")
    first = Path(tokenizer_folder(loaded.tokenizer, loaded.source, 256, tmp_path) or "")
    stamps = [(first / name).stat().st_mtime_ns for name in ("tokenizer.json",)]
    again = Path(tokenizer_folder(loaded.tokenizer, loaded.source, 256, tmp_path) or "")
    assert again == first
    assert [(again / "tokenizer.json").stat().st_mtime_ns] == stamps
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [first.name]  # no staging
    other = tokenizer_folder(loaded.tokenizer, loaded.source, 512, tmp_path)  # other content
    assert other is not None and Path(other) != first


def test_a_hugging_face_folder_is_its_own(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    loaded = resolve_model("random:tiny")
    got = tokenizer_folder(loaded.tokenizer, str(tmp_path / "model"), 256, tmp_path / "cache")
    assert got == str((tmp_path / "model").resolve())
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_is_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder would be
    loaded = resolve_model("random:tiny")
    with caplog.at_level(logging.WARNING):
        assert tokenizer_folder(loaded.tokenizer, loaded.source, 256, blocker) is None
    assert "LOCKSTEP_CACHE_DIR" in caplog.text
