"""`lockstep serve`: start the engine process, then serve the OpenAI-compatible API with
uvicorn in this one.

The engine runs in a process of its own (engine_process.py): this process keeps HTTP, the
tokenizer, chat templates, validation and rendering, and never initialises the device. The
model is loaded and the port bound before uvicorn starts, so a bad option, a model that will
not load or a port in use ends the command with one line on stderr and exit status 2, and
never with a half-started server. `--port 0` picks a free port; the line
`Lockstep serving <model> on http://<host>:<port>` on stderr names it.

SIGTERM or SIGINT stops accepting connections and lets running requests finish for up to
`--shutdown-timeout` seconds; whatever still runs then is aborted and its slots freed. The
process then exits with status 0.

An engine process that dies (killed, out of memory) makes the server print one line saying
so, fail what is in flight with a 503 (requests whose bodies are still arriving included),
answer /health with 503 "unhealthy" and exit with status 1. With `--tp` > 1, a worker process that dies does the same, naming its rank, and the
engine process stops the other workers (lockstep.parallel.group).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from lockstep.cli_options import add_engine_arguments, engine_options_from_args
from lockstep.config import EngineConfig
from lockstep.errors import ConfigError
from lockstep.server.tool_parser import TOOL_CALL_PARSERS

logger = logging.getLogger("lockstep.server")

# Seconds between the end of the grace period (requests still running are answered 503) and
# uvicorn's own deadline: enough for those answers to be written and the connections closed.
SHED_MARGIN_S = 5.0
# Connection hygiene (connections.py): enough connections for every sequence the GPU defaults
# admit to come on its own; long enough for a 32 MiB body over a slow link; far longer than a
# live link goes without a byte (TCP's retransmissions included); uvicorn's idle keep-alive.
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
DEFAULT_REQUEST_IDLE_TIMEOUT_S = 20.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0


def add_serve_parser(subparsers: Any) -> None:
    """Registers `serve` on the `lockstep` command's subparsers."""
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible HTTP API (see docs/server.md).",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: all)",
    )
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM/SIGINT",
    )
    parser.add_argument(
        "--max-waiting",
        type=_non_negative_int,
        default=None,
        help="sequences that may wait for a running slot beyond --max-running; more are "
        "refused with 429 and Retry-After (default: 4 x --max-running)",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections the server holds; a request on one more gets a 429 with "
        "Retry-After and the connection is closed",
    )
    parser.add_argument(
        "--request-read-timeout",
        type=_positive_float,
        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
        help="seconds a request's headers and body may take to arrive from its first byte; "
        "a slower one has its connection closed",
    )
    parser.add_argument(
        "--request-idle-timeout",
        type=_positive_float,
        default=DEFAULT_REQUEST_IDLE_TIMEOUT_S,
        help="seconds a request that has begun to arrive may go without a byte (nginx's "
        "client_body_timeout); a client that stops sending has its connection closed",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=_positive_float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help="seconds an idle connection (new, or between requests) stays open",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "none", *TOOL_CALL_PARSERS),
        help="how tool calls are read out of the model's output: hermes (<tool_call> JSON, "
        "Qwen's and Hermes' markup); auto (default): hermes when the chat template writes "
        "<tool_call>, else none (requests with tools and tool_choice other than none are "
        "refused)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LOCKSTEP_API_KEY") or None,
        help="require 'Authorization: Bearer <key>' on every route but /health (default: "
        "$LOCKSTEP_API_KEY; unset: no key)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("LOCKSTEP_ADMIN_API_KEY") or None,
        help="the key of the admin routes (/abort_request, /update_weights_from_disk, "
        "/flush_cache), which then do not take --api-key, and the only one shown where files "
        "are on disk (default: $LOCKSTEP_ADMIN_API_KEY; unset: --api-key guards them)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="Lockstep's and uvicorn's log level (default: info; debug also logs each request)",
    )
    add_engine_arguments(parser)
    parser.set_defaults(func=run_serve_command)


def run_serve_command(args: argparse.Namespace) -> int:
    # `lockstep`'s main may have configured logging already (then basicConfig does nothing):
    # the level of Lockstep's own loggers is set either way, so request logs (with `user`) show.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lockstep").setLevel(args.log_level.upper())
    try:
        config = EngineConfig.from_options(**engine_options_from_args(args))
        sock = _bind(args.host, args.port)
    except (ConfigError, OSError) as exc:
        print(f"lockstep serve: error: {exc}", file=sys.stderr)
        return 2
    if not args.api_key and not _is_loopback(args.host):  # said before the model loads
        logger.warning(
            "listening on %s without an API key: anyone who can reach this port can use the "
            "model%s; set --api-key or LOCKSTEP_API_KEY",
            args.host,
            "" if args.admin_api_key else ", abort others' requests and replace the weights",
        )
    from lockstep.server.engine_process import EngineProcess, EngineStartError

    try:
        engine = EngineProcess(config, args.log_level)
    except EngineStartError as exc:
        sock.close()
        print(f"lockstep serve: error: {exc}", file=sys.stderr)
        return exc.exit_status
    try:
        return _serve(args, engine, sock)
    finally:
        engine.close()


def _serve(args: argparse.Namespace, engine: Any, sock: socket.socket) -> int:
    """Serve HTTP over the started engine process until a signal or its death."""
    import uvicorn

    from lockstep.server.api import build_app
    from lockstep.server.connections import guarded_protocol, raise_fd_limit

    app = build_app(
        engine,
        max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )
    raise_fd_limit(args.max_connections)
    protocol = guarded_protocol(
        read_timeout_s=args.request_read_timeout,
        idle_timeout_s=args.request_idle_timeout,
        max_connections=args.max_connections,
        on_error=app.state.metrics.count_error,
    )
    grace = args.shutdown_timeout

    def end_of_grace() -> None:
        app.state.shed(
            f"the server is shutting down: the request did not finish within {grace:g} s"
        )

    server = _server_class(grace, end_of_grace)(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            # uvicorn's own deadline comes after ours, so that it never has to cancel a
            # handler (a traceback and a bare 500) to stop.
            timeout_graceful_shutdown=grace + SHED_MARGIN_S,
            access_log=args.log_level == "debug",
            http=protocol,
            timeout_keep_alive=args.keep_alive_timeout,
        )
    )
    failures: list[str] = []

    def on_engine_failure(message: str) -> None:
        # The engine process or a tensor-parallel worker died: report unhealthy, shut down,
        # exit with status 1.
        failures.append(message)
        print(f"lockstep serve: error: {message}; shutting down", file=sys.stderr)
        sys.stderr.flush()
        server.should_exit = True

    engine.on_failure(on_engine_failure)
    host, port = sock.getsockname()[:2]
    print(f"Lockstep serving {engine.info.model_name} on http://{host}:{port}", file=sys.stderr)
    sys.stderr.flush()
    server.run(sockets=[sock])
    return 1 if failures else 0


def _server_class(grace_s: float, end_of_grace: Callable[[], None]) -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that:
        - `grace_s` after the first SIGTERM or SIGINT, `end_of_grace` runs (it answers what
          still runs with a 503, or an error event and [DONE] on a stream);
        - the shutdown a signal asked for ends the process with status 0 (uvicorn re-raises
          the signal once it has shut down, which reads as a crash to process supervisors)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                timer = threading.Timer(grace_s, end_of_grace)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected an integer >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected a number of seconds > 0")
    return value


def _bind(host: str, port: int) -> socket.socket:
    """Binds now (not inside uvicorn) so that a port in use is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves beyond this machine
