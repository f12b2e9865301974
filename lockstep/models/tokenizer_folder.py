"""The served model's tokenizer as a Hugging Face folder, for tools that load tokenizers
from `tokenizer.json` folders and cannot read a GGUF file (sglang-router's cache-aware
policy, docs/scale-out.md).

A Hugging Face folder or hub snapshot already is such a folder and is reported as it is. For
any other source (a GGUF file, a `random:` preset) `tokenizer_folder` writes one into
Lockstep's cache (`$LOCKSTEP_CACHE_DIR/tokenizers/<content hash>/`, else
`~/.cache/lockstep/...`): `tokenizer.json` (the backend's own vocabulary, merges, normalizer
and pre-tokenizer; a post-processor that adds BOS exactly when Lockstep does) and
`tokenizer_config.json` (class, special tokens, `add_bos_token`, chat template, context
length). Loaded by transformers or the `tokenizers` crate, it gives Lockstep's own token ids.

The folder is named by a hash of its contents, written beside its final place and renamed
into it, so replicas that start at once write the same folder without seeing a half-written
one, and a folder that exists is never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import processors

from lockstep.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_files(tokenizer: Tokenizer, model_max_length: int) -> dict[str, str]:
    """The text of `tokenizer.json` and `tokenizer_config.json` for `tokenizer`."""
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    if tokenizer.add_bos:
        bos = tokenizer.bos_token
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.bos_token_id)],
        )
        tokenizer_json = backend.to_str()
    else:  # Lockstep adds nothing: neither may a loader of the folder
        tokenizer_json = json.dumps({**json.loads(backend.to_str()), "post_processor": None})
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": tokenizer.chat_template,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config, indent=2)}


def tokenizer_folder(
    tokenizer: Tokenizer, source: str, model_max_length: int, cache_root: Path
) -> str | None:
    """A Hugging Face tokenizer folder for the model loaded from `source`: `source` itself
    when it is a folder with a `tokenizer.json`, else one written under
    `cache_root/tokenizers/`. None (with a warning logged) when that cannot be written: the
    folder serves routers' tokenizer-based features, never the server's own work."""
    if (Path(source) / "tokenizer.json").is_file():
        return str(Path(source).resolve())
    files = hf_files(tokenizer, model_max_length)
    digest = hashlib.sha256()
    for name in FILES:
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    folder = cache_root / "tokenizers" / digest.hexdigest()[:16]
    if all((folder / name).is_file() for name in FILES):
        return str(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
        try:
            for name in FILES:
                (staging / name).write_text(files[name], encoding="utf-8")
            os.replace(staging, folder)
        except OSError:
            if not all((folder / name).is_file() for name in FILES):
                raise  # not another replica's rename that won the race
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.warning(
            "could not write the tokenizer folder %s (%s): routers that load the tokenizer "
            "from /server_info's model_path will not find one; set LOCKSTEP_CACHE_DIR to a "
            "writable folder",
            folder,
            exc.strerror or exc,
        )
        return None
    return str(folder)
