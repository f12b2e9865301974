"""Weights trained by `lockstep.training` served over HTTP: a real `lockstep serve` on a tiny
Qwen3 folder, a training module on the same folder trained a few steps and saved with
`save_pretrained`, then `POST /update_weights_from_disk`: the server's `/v1/score` of a
sequence equals the module's logprobs bit for bit (before the update it gave the untrained
module's bits, and differed from the trained ones: the control)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from test_server import ServerProcess

pytest.importorskip("transformers")
from lockstep.training import LockstepForCausalLM  # noqa: E402
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-tokens", "2048", "--max-batch-tokens",
        "64", "--chunk-size", "16", "--max-model-len", "256"]  # fmt: skip
PROBES = [[(11 * j + 3 * i) % 290 + 5 for j in range(n)] for i, n in enumerate((40, 7, 23))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("training_server") / "qwen3"
    save_tiny("qwen3", path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _served_logprobs(http: httpx.Client, model: str) -> list[list[float]]:
    """`/v1/score` of each probe: the logprobs of its tokens 1.. (JSON floats: exact)."""
    out = []
    for ids in PROBES:
        response = http.post("/v1/score", json={"model": model, "prompt": ids})
        assert response.status_code == 200, response.text
        logprobs = response.json()["data"][0]["logprobs"]
        assert logprobs[0] is None and len(logprobs) == len(ids)
        out.append(logprobs[1:])
    return out


def _module_logprobs(model: LockstepForCausalLM) -> list[list[float]]:
    with torch.no_grad():
        return [lp.tolist() for lp in model(PROBES).per_sequence()]


def test_update_weights_from_disk_serves_the_trainer_bits(
    server: ServerProcess, http: httpx.Client, folder: Path, tmp_path: Path
) -> None:
    model = LockstepForCausalLM.from_pretrained(str(folder))
    assert _served_logprobs(http, server.model) == _module_logprobs(
        model
    )  # the same weights, the same bits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        out = model(PROBES)
        loss = -out.logprobs.sum() / out.mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trained = _module_logprobs(model)
    assert (
        _served_logprobs(http, server.model) != trained
    )  # the control: the server holds the old weights
    model.save_pretrained(tmp_path / "trained")
    response = http.post(
        "/update_weights_from_disk",
        json={"model_path": str(tmp_path / "trained"), "weight_version": "trained-3"},
    )
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    assert http.get("/get_model_info").json()["weight_version"] == "trained-3"
    assert _served_logprobs(http, server.model) == trained
