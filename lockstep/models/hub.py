"""Models named by Hugging Face hub id (`--model org/name`, optionally `--revision`).

The id is resolved by `huggingface_hub` exactly as transformers resolves it: from the user's
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), downloading what
is missing where the network allows (with the hub's progress bars, `HF_TOKEN` for private and
gated repos), and from the cache alone under `HF_HUB_OFFLINE=1`. Only the files the folder
loader reads are fetched. Every failure is one `ModelLoadError` line that names the id, the
revision and the cache it looked in.

A GGUF file of a hub repo is named `org/name/F.gguf` (`lockstep.model_arguments`, which also
tells a hub id from a path): that one file is
resolved the same way. A repo of GGUF files named without one is refused with the files it
holds.

A `--model` that exists on disk is always a path; only a missing path of the form `org/name`
(or `org/name/F.gguf`) is taken for a hub id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from lockstep.errors import ModelLoadError

# What lockstep/models/hf_loader.py reads from a model folder; nothing else is downloaded.
FOLDER_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
]


def describe(repo_id: str, revision: str | None) -> str:
    """How errors name what was asked for: `--model 'org/name' --revision 'v1'`."""
    return f"--model {repo_id!r}" + (f" --revision {revision!r}" if revision else "")


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local folder of `repo_id` at `revision` (default: the main branch), from the cache
    or downloaded into it. Raises ModelLoadError (one line) when the repo or the revision does
    not exist, or is not cached and cannot be downloaded."""
    from huggingface_hub import snapshot_download

    with _one_line_errors(repo_id, revision):
        from huggingface_hub import constants

        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=FOLDER_FILES,
            local_files_only=bool(constants.HF_HUB_OFFLINE),
        )
    return Path(folder)


def hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """The local path of one file of `repo_id` at `revision`, from the cache or downloaded
    into it; the errors of `hub_snapshot`, and a file the repo does not hold is one line that
    names the GGUF files it does hold (where the cache shows them)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    wanted = describe(f"{repo_id}/{filename}", revision)
    held = gguf_files(repo_id, revision)
    with _one_line_errors(repo_id, revision, wanted):
        offline = bool(constants.HF_HUB_OFFLINE)
        try:
            path = hf_hub_download(repo_id, filename, revision=revision, local_files_only=offline)
        except (EntryNotFoundError, LocalEntryNotFoundError):
            if held is None:  # the revision itself is not cached: said as for a folder
                raise
            raise ModelLoadError(
                f"{wanted}: the repository holds no {filename!r}; its GGUF files: "
                f"{', '.join(f'{repo_id}/{name}' for name in held) or 'none'}"
            ) from None
    return Path(path)


def gguf_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The .gguf files of the cached snapshot of `repo_id` at `revision` (None: no such
    snapshot in the cache)."""
    from huggingface_hub import constants

    repo_dir = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    ref = repo_dir / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    snapshot = repo_dir / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        return None
    return sorted(p.name for p in snapshot.iterdir() if p.name.lower().endswith(".gguf"))


@contextlib.contextmanager
def _one_line_errors(
    repo_id: str, revision: str | None, wanted: str | None = None
) -> Iterator[None]:
    """huggingface_hub's errors as one `ModelLoadError` line naming what was asked for."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(constants.HF_HUB_CACHE)
    offline = bool(constants.HF_HUB_OFFLINE)
    wanted = wanted or describe(repo_id, revision)
    try:
        yield
    except GatedRepoError:
        raise ModelLoadError(
            f"{wanted}: the repository is gated; accept its terms on the hub and set HF_TOKEN "
            "to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{wanted}: no such repository on the Hugging Face hub (a private one needs "
            "HF_TOKEN); a local folder of that name does not exist either"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{wanted}: the repository has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(_not_cached(wanted, repo_id, revision, cache, offline)) from None
    except HfHubHTTPError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{wanted}: the Hugging Face hub answered: {first}") from None
    except OSError as exc:  # the cache is not writable, the disk is full
        raise ModelLoadError(
            f"{wanted}: cannot use the Hugging Face cache {cache}: {exc.strerror or exc} "
            "(set HF_HUB_CACHE or HF_HOME to a writable folder)"
        ) from None


def _not_cached(wanted: str, repo_id: str, revision: str | None, cache: Path, offline: bool) -> str:
    """Why a repo or revision is not in the cache, naming the folder looked in and what it
    does hold."""
    why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        return (
            f"{wanted}: no local folder of that name, not in the Hugging Face cache (no "
            f"{repo_dir}) and {why}; download it where the network allows, or point "
            "HF_HUB_CACHE or HF_HOME at the cache that holds it"
        )
    refs = " ".join(sorted(p.name for p in (repo_dir / "refs").glob("*")))
    snapshots = " ".join(sorted(p.name[:12] for p in (repo_dir / "snapshots").glob("*")))
    held = "; ".join(
        f"{kind} {names}" for kind, names in (("refs", refs), ("snapshots", snapshots)) if names
    )
    return (
        f"{wanted}: revision {revision or 'main'!r} is not in the Hugging Face cache "
        f"{repo_dir} (it holds {held or 'nothing'}) and {why}"
    )
