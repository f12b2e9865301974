"""The engine in a process of its own, so that the step loop never waits for the HTTP
process's interpreter (its event loop, JSON, tokenization and rendering):

    HTTP process (uvicorn, front end)            engine process (spawned; torch lives here)
    ---------------------------------            ------------------------------------------
    AsyncEngine --- EngineProcess.send --pipe--> reader thread -> EngineLoop.post
                                                 main thread: EngineLoop.run (Engine.step)
    event loop <-- reader thread <------pipe---- writer thread <- events (outputs per step)

Messages are the frozen dataclasses of engine_wire.py, pickled; a step's outputs cross as
`PackedOutputs` (tuples of ids and floats, checked field by field against `StepOutput` on
arrival), never as code. The engine makes no text
(`Engine(detokenize=False)`): the HTTP process detokenizes and looks for stop strings
(output_text.py), off the step loop. Structured outputs' grammars are compiled by the reader
thread as their requests arrive, so the step loop finds them compiled.

The engine process ignores SIGINT and SIGTERM (the HTTP process drains, then sends "stop") and
dies with the HTTP process (PR_SET_PDEATHSIG, and end of file on its pipe). If it dies first,
the HTTP process fails whatever is in flight with a 503 and the server exits with status 1.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from lockstep.errors import LockstepError
from lockstep.server.engine_loop import EngineLoop
from lockstep.server.engine_wire import (
    AddRequests,
    Command,
    EngineInfo,
    Event,
    Fatal,
    Outputs,
    PackedOutputs,
    Ready,
    Reply,
    StartFailed,
    Stop,
    pack_outputs,
    unpack_outputs,
)

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # after "stop": the engine aborts, closes its workers and exits


class EngineStartError(LockstepError):
    """The engine process could not load the engine: its one-line message, and the status
    `lockstep serve` exits with (2 for a bad option or model, as before the split)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class EngineProcess:
    """The parent's handle on the engine process: spawned and loaded by the constructor
    (which raises `EngineStartError`), then an `EngineLink` for `AsyncEngine`."""

    def __init__(self, config: Any, log_level: str = "info") -> None:
        ctx = mp.get_context("spawn")  # never fork a process that holds torch's threads
        self._conn, child = ctx.Pipe()
        # Not a daemon: a tensor-parallel engine starts processes of its own.
        self.process = ctx.Process(
            target=engine_process_main, args=(config, child, log_level),
            name="lockstep-engine", daemon=False,
        )  # fmt: skip
        self.process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._closing = False
        self._callbacks: list[Callable[[str], None]] = []
        self.failure: str | None = None
        self._grammars: Any = None
        try:
            self.info = self._wait_ready()
        except BaseException:  # a start-up error, or Ctrl-C while the model loads
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
            raise

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def grammars(self) -> Any:
        """A grammar compiler of the front end's own: it refuses a bad grammar with a 400
        before any engine work (the engine compiles the request's again)."""
        if self._grammars is None:
            from lockstep.engine.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.info.tokenizer, self.info.model_vocab_size)
        return self._grammars

    def _wait_ready(self) -> EngineInfo:
        wait([self._conn, self.process.sentinel])
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(STOP_TIMEOUT_S)
            raise EngineStartError(
                f"the engine process exited with {_status(self.process.exitcode)} while "
                "loading the model",
                1,
            ) from None
        if isinstance(message, StartFailed):
            self.process.join(STOP_TIMEOUT_S)
            raise EngineStartError(message.message, message.exit_status)
        if not isinstance(message, Ready):
            raise TypeError(f"the engine process said {message!r} before it was ready")
        return message.info

    def start(self, deliver: Callable[[Event], None]) -> None:
        """Deliver every event from now on (from a reader thread of this process)."""
        threading.Thread(
            target=self._read, args=(deliver,), name="lockstep-engine-reader", daemon=True
        ).start()

    def send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except OSError:
                pass  # the engine process is gone: the reader reports it

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` (from the reader thread) once the engine cannot go on:
        its process died, or a tensor-parallel worker of it did."""
        self._callbacks.append(callback)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine process (it aborts what still runs) and wait for it; killed if it
        does not exit within `timeout`. Idempotent."""
        self._closing = True
        self.send(Stop())
        self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine process did not stop within %g s: killed", timeout)
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()

    def _read(self, deliver: Callable[[Event], None]) -> None:
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(event, PackedOutputs):
                event = unpack_outputs(event)
            elif isinstance(event, Fatal):
                self._fail(event.message)
            deliver(event)
        if self._closing:
            return
        self.process.join(2.0)  # its exit status, for the message
        message = (
            f"the engine process (pid {self.process.pid}) died "
            f"({_status(self.process.exitcode)}): the server cannot continue"
        )
        self._fail(message)
        deliver(Fatal(message))

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        for callback in self._callbacks:
            try:
                callback(message)
            except Exception:
                logger.exception("engine failure callback failed")


def _status(exitcode: int | None) -> str:
    if exitcode is None:
        return "an unknown status"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"status {exitcode}"


# -- in the engine process --------------------------------------------------------------


def engine_process_main(config: Any, conn: Connection, log_level: str) -> None:
    """The engine process: load the engine, say "ready" with its `EngineInfo` (or "error"
    with the one line the user sees), then run the loop until "stop" or the parent is gone."""
    from lockstep.parallel.worker import die_with_parent

    die_with_parent()
    # The HTTP process owns shutdown: a Ctrl-C reaches the whole process group, and the engine
    # must go on serving the requests the server drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lockstep").setLevel(log_level.upper())
    from lockstep.engine.engine import Engine
    from lockstep.parallel.group import TensorParallelError

    threads = _default_cpu_threads(config)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        engine = Engine(config, detokenize=False)
        info = EngineInfo.of(engine)
    except (LockstepError, TensorParallelError) as exc:
        conn.send(StartFailed(str(exc), 2))
        return
    except BaseException as exc:
        logger.exception("the engine failed to load")
        conn.send(StartFailed(f"the engine failed to load: {type(exc).__name__}: {exc}", 1))
        return
    events: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
    loop = EngineLoop(engine, events.put)
    engine.on_failure(lambda message: events.put(Fatal(message)))
    conn.send(Ready(info))
    writer = threading.Thread(target=_write, args=(conn, events, loop), daemon=True)
    writer.start()
    threading.Thread(target=_read_commands, args=(conn, loop, engine), daemon=True).start()
    try:
        loop.run()
    finally:
        engine.close()
        events.put(None)
        writer.join(STOP_TIMEOUT_S)
    # Threads blocked on the pipe would hold the interpreter's exit.
    os._exit(0)


def _default_cpu_threads(config: Any) -> int | None:
    """torch's threads for a CPU engine given no --num-threads: every usable core (affinity
    and CPU quota, lockstep/cpu_threads.py) but one, which the HTTP process keeps for its
    event loop, tokenization and text. torch's default (every core)
    leaves that process, and a client on the same machine, to wait for a time slice behind the
    step's threads at each turn of every request. None: leave torch's default (a GPU engine,
    or threads asked for). The CPU kernels give the same bits at any thread count."""
    if config.num_threads is not None or config.resolved_device != "cpu":
        return None
    from lockstep.cpu_threads import usable_cores

    return max(1, usable_cores() - 1)


def _read_commands(conn: Connection, loop: EngineLoop, engine: Any) -> None:
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            loop.post(Stop())
            return
        if isinstance(command, AddRequests):
            _compile_grammars(engine, command.requests)
        loop.post(command)


def _compile_grammars(engine: Any, requests: list[tuple[str, list[int], Any]]) -> None:
    """Compile the requests' structured outputs here, off the step loop: `add_request` then
    finds them in the compiler's cache (a spec that does not compile is refused there)."""
    for _, _, params in requests:
        if params.structured_output is not None:
            try:
                engine.grammars.grammar(params.structured_output)
            except LockstepError:
                pass


def _write(conn: Connection, events: queue.SimpleQueue, loop: EngineLoop) -> None:
    """Sends the loop's events, so that a step never waits on the pipe."""
    while True:
        event = events.get()
        if event is None:
            return
        wire = pack_outputs(event) if isinstance(event, Outputs) else event
        try:
            conn.send(wire)
        except OSError:  # the HTTP process is gone
            loop.post(Stop())
            return
        except Exception as exc:  # a value that does not pickle: a bug, but never a hang
            logger.exception("an engine event could not be sent")
            if isinstance(event, Reply):
                conn.send(Reply(event.call_id, None, RuntimeError(f"{type(exc).__name__}: {exc}")))
