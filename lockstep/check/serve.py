"""Start Lockstep itself as a subprocess for `lockstep check --serve`.

The server runs as `python -m lockstep serve --host 127.0.0.1 --port <port> ...` (a free port
unless one is given) with the engine options passed through, its output going to a log file whose tail is shown if it dies
or never becomes healthy. It is stopped (SIGTERM, then SIGKILL) when the context exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx


class ServeError(Exception):
    """The Lockstep server did not start or did not become healthy."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LockstepServer:
    """A Lockstep server subprocess on loopback; `url` is set once /health answers."""

    def __init__(
        self, engine_args: list[str], *, startup_timeout_s: float = 600.0, port: int | None = None
    ) -> None:
        self.engine_args = list(engine_args)
        self.startup_timeout_s = startup_timeout_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = tempfile.NamedTemporaryFile(  # closed in stop()
            prefix="lockstep-check-serve-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log_file.name)
        self.keep_log = False  # set to keep the log after a clean exit (e.g. a check failed)

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lockstep",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.engine_args,
        ]

    def __enter__(self) -> LockstepServer:
        self._proc = subprocess.Popen(
            self.command,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise ServeError(
                    f"`{' '.join(self.command)}` exited with code {code} before answering"
                    f" /health; its log ends:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServeError(
            f"`{' '.join(self.command)}` did not answer /health within"
            f" {self.startup_timeout_s:.0f} s; its log ends:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        self._log_file.flush()
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log_file.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc_type is None and not self.keep_log:
            self.log_path.unlink(missing_ok=True)
