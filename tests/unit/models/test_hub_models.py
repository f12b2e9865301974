"""Models by Hugging Face hub id (`--model org/name`, `--revision`), read from a hub cache that
the test lays out as `huggingface_hub` does (no machine here reaches the hub): the CLI in a
subprocess with the real environment variables (HF_HOME, HF_HUB_OFFLINE), and the one-line
errors in-process with huggingface_hub's constants patched (it reads its environment once, at
import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_hf import save_tiny, write_hub_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
REPO_ID = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"
ARGS = ["--raw", "--max-tokens", "4", "--kv-tokens", "256", "--max-model-len", "256",
        "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds REPO_ID at main (COMMIT) and at tag v1 (TAGGED,
    other weights), as `huggingface_hub` lays a cache out."""
    root = tmp_path_factory.mktemp("hf")
    save_tiny("qwen3", root / "main")
    save_tiny("qwen3", root / "v1", seed=11)
    write_hub_cache(root / "home" / "hub", REPO_ID, root / "main", COMMIT)
    write_hub_cache(root / "home" / "hub", REPO_ID, root / "v1", TAGGED, ref="v1")
    return root / "home"


@pytest.fixture
def offline_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home / "hub"


def _lockstep(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_generate_by_hub_id_from_hf_home_offline(hf_home: Path) -> None:
    out = _lockstep(hf_home, "generate", "hello", "--model", REPO_ID, *ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_missing_repo_is_one_line_exit_2_in_a_subprocess(hf_home: Path) -> None:
    out = _lockstep(hf_home, "generate", "hello", "--model", "tiny-org/absent", *ARGS)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "'tiny-org/absent'" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert str(hf_home / "hub" / "models--tiny-org--absent") in lines[0]


def test_revisions_resolve_to_their_snapshots(offline_cache: Path) -> None:
    from lockstep.models.resolver import resolve_model

    snapshots = offline_cache / "models--tiny-org--tiny-qwen3" / "snapshots"
    main = resolve_model(REPO_ID)
    assert main.name == REPO_ID  # served under the hub id
    assert main.source == str(snapshots / COMMIT)
    assert resolve_model(REPO_ID, revision="v1").source == str(snapshots / TAGGED)
    assert resolve_model(REPO_ID, revision=TAGGED).source == str(snapshots / TAGGED)


def _cli_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    from lockstep import cli

    capsys.readouterr()  # what came before (transformers' progress bars)
    assert cli.main(["generate", "hello", *args, *ARGS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_missing_revision_is_one_line(offline_cache: Path, capsys) -> None:
    err = _cli_error(capsys, "--model", REPO_ID, "--revision", "v2")
    assert "--revision 'v2'" in err and "refs main v1" in err
    assert str(offline_cache / "models--tiny-org--tiny-qwen3") in err


def test_incomplete_snapshot_is_one_line(
    offline_cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A download cut short leaves a snapshot link whose blob never arrived."""
    from huggingface_hub import constants

    save_tiny("qwen3", tmp_path / "model")
    snapshot = write_hub_cache(tmp_path / "hub", REPO_ID, tmp_path / "model", COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (snapshot / "model.safetensors").resolve().unlink()
    err = _cli_error(capsys, "--model", REPO_ID)
    assert "snapshot is incomplete" in err and "model.safetensors is missing" in err


def test_revision_without_a_hub_id_is_refused(capsys) -> None:
    err = _cli_error(capsys, "--model", "random:tiny", "--revision", "v1")
    assert "revision='v1'" in err and "org/name" in err


def test_an_existing_folder_is_a_path_not_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    from lockstep.model_arguments import is_hub_id

    monkeypatch.chdir(tmp_path)
    assert is_hub_id(REPO_ID)
    (tmp_path / REPO_ID).mkdir(parents=True)
    assert not is_hub_id(REPO_ID)
    assert not is_hub_id("./org/name") and not is_hub_id("org/../name")
    assert not is_hub_id("models/missing.gguf")  # a missing file, said as such


GGUF_REPO = "gguf-org/tiny-gguf"
GGUF_FILE = "tiny-llama.F32.gguf"


@pytest.fixture
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache, offline, whose GGUF-only repo holds a tiny llama GGUF file (linked, as
    the cache links snapshot files to blobs). Returns the file."""
    from huggingface_hub import constants
    from test_models_loading import write_tiny_gguf

    gguf = tmp_path / GGUF_FILE
    write_tiny_gguf(gguf)
    repo = tmp_path / "hub" / ("models--" + GGUF_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / GGUF_FILE).symlink_to(gguf)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return gguf


def test_a_gguf_file_of_a_hub_repo_by_org_name_file(gguf_cache: Path, capsys) -> None:
    """`--model org/name/F.gguf` generates what the file F itself does, served under that
    name; `--model org/name` of a repo of GGUF files, or a file it does not hold, is one line
    naming the files it holds."""
    from lockstep import cli
    from lockstep.models.resolver import resolve_model

    by_id = f"{GGUF_REPO}/{GGUF_FILE}"
    assert resolve_model(by_id).name == by_id
    texts = []
    for model in (by_id, str(gguf_cache)):
        capsys.readouterr()
        assert cli.main(["generate", "hello", "--model", model, *ARGS]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip(), texts
    for model in (GGUF_REPO, f"{GGUF_REPO}/Other.Q8_0.gguf"):
        assert cli.main(["generate", "hello", "--model", model, *ARGS]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and by_id in err, err
        assert f"--model {model!r}" in err, err
