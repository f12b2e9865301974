"""What a `--model` argument names, told from its text and whether such a local path exists:
a Hugging Face hub id (`org/name`) or one GGUF file of a hub repo (`org/name/F.gguf`). No
network and no model code, so that the validated config (lockstep/config.py), which the HTTP
process loads without torch, can tell a hub id from a path; lockstep/models/hub.py resolves
what these name.

A `--model` that exists on disk is always a path; only a missing path of the form `org/name`
(or `org/name/F.gguf`) is taken for a hub id.
"""

from __future__ import annotations

import re
from pathlib import Path

# The hub's own rule for ids: an owner and a name of letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_HUB_GGUF = re.compile(r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)/([\w.-]+\.gguf)", re.IGNORECASE)


def is_hub_id(model: str) -> bool:
    """Whether `model` is to be read as a hub id: of the form org/name and not a local path
    (nor a missing GGUF file's path, which is reported as a missing file)."""
    return (
        bool(_HUB_ID.fullmatch(model))
        and ".." not in model
        and not model.lower().endswith(".gguf")
        and not Path(model).exists()
    )


def hub_gguf_file(model: str) -> tuple[str, str] | None:
    """(repo id, file name) where `model` names a GGUF file of a hub repo, `org/name/F.gguf`
    (and no local path); else None."""
    match = _HUB_GGUF.fullmatch(model)
    if match is None or ".." in model or Path(model).exists():
        return None
    return match.group(1), match.group(2)
