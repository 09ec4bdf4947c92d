"""The EngineCore in a process of its own, so that HTTP, SSE and tokenizing never take its interpreter.

    server process (this one)                         core process (spawned)
    -------------------------------------------       ----------------------------------------------
    handlers (event loop) and ProcessEngineLoop        loop: take the commands, step, send events
      submit  -> ("add", EngineRequest)   ---------->    core.add(request) -> ("accepted", id, n)
      abort   -> ("abort", request_id)    ---------->    core.abort(request_id)        or ("rejected", ...)
      stop    -> ("stop",)                ---------->    core.close()
      ("batch", [command, ...]): the aborts the engine thread collected, in order, as one message
      handlers' events  <---- ("events", [event tuple, ...], Snapshot) one message per step

A request goes to the core from its handler, on the server's event loop, the moment it is parsed: not
through the engine thread. Two threads of one process share one interpreter lock, and a thread woken by
a pipe waits for it while the other does socket work: an event loop taking in a burst of 256 clients
kept the engine thread from forwarding anything until the whole burst was in: every request of it went
to the core in one message (benchmarks/NOTES_step_profile.md). Sent at once, the first requests of a
burst are prefilled while the rest are still arriving. The core takes every command that is waiting
before it steps, and, inside a step, the requests that arrived while the last one was launched, right
before the step forms its batch (`Inbox`, `EngineCore.intake`): with async scheduling a step's successor
is formed inside the same call, so without that a burst's requests waited two steps.

The core runs steps back to back while it has work, whatever the server is doing: a server busy
writing SSE chunks just finds several steps' events waiting and hands each client all its new
tokens in one chunk. Requests and events cross the boundary as they are (plain dataclasses,
pickled). The core sends token ids and the server's engine thread makes the text from them (a
`TextStream` per sample, minikv/engine/detokenizer.py), except for requests with stop strings, whose
text decides where they end: the core makes theirs (the detokenizer's docstring says why).

What the server reads of the engine (queues for 429/503, pool usage for /metrics) comes as a
`ViewSnapshot` (minikv/engine/view.py) with every step's events, and with every answer to a command.

Neither side's messages go through a multiprocessing queue. A queue's put hands the message to a feeder
thread that pickles and writes it, and that thread takes its process's interpreter lock: in the core,
while the core steps, a core that is host-bound on a GPU (what it cost: benchmarks/host_run_cpu.py and
NOTES_step_profile.md); in the server, while the event loop works. So each side pickles its messages in
the thread that sends them (`EventWriter`; the server's `CommandWriter` takes several threads) and writes
them to a pipe that never blocks the sender: what the pipe cannot take now waits in the writer and goes
with the next message, or when the sender's loop comes round. The reader reads the pipe as a `Connection`
(`EventReader`), whose framing the writer writes.
"""
from __future__ import annotations

import fcntl
import gc
import json
import multiprocessing as mp
import os
import queue
import select
import struct
import threading
import time
import traceback
from collections import namedtuple
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace

from minikv.engine.core import EngineEvent, EngineRequest
from minikv.engine.gc_pause import frozen_heap, refreeze
from minikv.engine.prompts import parse_prompt
from minikv.engine.sampling_params import SamplingParams

START_TIMEOUT_S = 600.0  # loading a large model onto a GPU may take minutes
PARENT_CHECK_S = 1.0  # an idle core looks this often whether the server that started it still lives
FLUSH_WAIT_S = 0.002  # an idle core with messages the pipe could not take yet tries again this often
LAST_WORDS_S = 2.0  # a stopping core's last messages: how long it waits for the server to read them
COMMAND_PIPE_BYTES = 1 << 20  # the command pipe's capacity, where the system allows it: a burst's requests
#   fit whole while the core finishes a step (64 KiB, Linux's default, holds a few dozen long prompts)
USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}  # the user's to fix: one line


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know of the engine it does not hold."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    source: str


class EventWriter:
    """The core's end of its pipe to the server. `put` pickles a message in the calling thread and writes
    it, framed as `Connection.send_bytes` frames it, without ever blocking: what the pipe cannot take now
    stays here, in order, until `flush` (every put flushes first). `finish` waits for the reader."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._pending = bytearray()

    @property
    def pending(self) -> int:
        """Bytes written by `put` that the pipe has not taken yet."""
        return len(self._pending)

    def put(self, msg) -> None:
        self._append(ForkingPickler.dumps(msg))

    def _append(self, data: bytes) -> None:
        n = len(data)
        self._pending += struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        self._pending += data
        self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; True once nothing is pending."""
        while self._pending:
            try:
                n = os.write(self._fd, self._pending)
            except BlockingIOError:
                return False
            except BrokenPipeError:  # the server is gone: nobody will read these (the core ends when idle)
                self._pending.clear()
                break
            del self._pending[:n]
        return True

    def finish(self, timeout: float = LAST_WORDS_S) -> bool:
        """Wait (up to `timeout`) until the server has taken everything; True if it has."""
        deadline = time.monotonic() + timeout
        while not self.flush():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [self._fd], [], left)
        return True


class CommandWriter(EventWriter):
    """The server's end of the command pipe: EventWriter's never-blocking put, from any thread (a handler
    adds its request on the event loop, the engine thread sends aborts): each message goes whole and in
    the order of the puts. What the pipe cannot take now goes with the next put or the engine thread's
    next turn (ProcessEngineLoop), or at `finish`."""

    def __init__(self, conn: Connection):
        super().__init__(conn)
        self._lock = threading.RLock()
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, COMMAND_PIPE_BYTES)
        except (OSError, AttributeError):  # above the system's limit (or no such call): the default size
            pass

    def fileno(self) -> int:
        return self._fd

    def _append(self, data: bytes) -> None:  # (pickled outside the lock, in the sender's own time)
        with self._lock:
            super()._append(data)

    def flush(self) -> bool:
        with self._lock:
            return super().flush()


class EventReader:
    """A reader's end of a pipe: its messages, in order, as a queue's `get` gives them. `closed` once the
    writer's end is closed and everything it wrote has been read."""

    def __init__(self, conn: Connection):
        self.conn = conn  # what the server's engine thread waits on (multiprocessing.connection.wait)
        self.closed = False

    def get(self, timeout: float | None = None):
        """The next message; queue.Empty if none came within `timeout`, or if the writer's end is closed."""
        if self.closed or not self.conn.poll(timeout):
            raise queue.Empty
        try:
            return self.conn.recv()
        except EOFError:  # the writer is gone: nothing more will come (the caller asks whether it lives)
            self.closed = True
            raise queue.Empty from None

    def get_nowait(self):
        return self.get(0)


def _core_main(model, options: dict, command_end: Connection, conn: Connection, detokenize: bool = True) -> None:
    """The core process: build the engine, then take commands and step until told to stop. With
    MINIKV_CORE_PROFILE=PATH set, the loop runs under cProfile and its stats go to PATH on stop; with
    MINIKV_STEP_TRACE=PATH, every step's moment, tokens and sequences go to PATH, and the loop's turns and
    collections to PATH.loop.json (`_serve_commands`), each time the core falls idle (step_trace.py)."""
    commands, results = EventReader(command_end), EventWriter(conn)
    path = os.environ.get("MINIKV_CORE_PROFILE")
    try:
        if not path:
            return _core_loop(model, options, commands, results, detokenize, own_process=True)
        import cProfile

        profile = cProfile.Profile()
        try:
            profile.runcall(_core_loop, model, options, commands, results, detokenize, True)
        finally:
            profile.dump_stats(path)
    finally:
        results.finish()  # its last words ("stopped", or why it could not start) reach the server


def _core_loop(model, options: dict, commands, results, detokenize: bool, own_process: bool = False) -> None:
    """own_process: this is the engine's own process (`_core_main`), where nothing else lives: its heap is
    frozen again each time it falls idle (`_serve_commands`). Not in a process that other engines share (a
    test that runs this loop in its own thread): a refreeze there would freeze their objects too."""
    try:
        from minikv.engine.llm import LLM

        llm = LLM(model, **options)
        if not llm.is_paged:
            raise ValueError("the server runs the continuous-batching engine: build it with kv_backend='paged'")
        core, view = llm.core, llm.view
        core.detokenize = detokenize  # off: the server makes the text of requests without stop strings
        results.put(("ready", CoreInfo(core.max_model_len, llm.config.vocab_size, view.num_blocks,
                                       view.block_size, str(llm.loaded.source)), view.snapshot()))
    except BaseException as e:  # noqa: BLE001  the server says why and exits
        results.put(("start_failed", type(e).__name__, str(e), traceback.format_exc()))
        return
    steps_path, on_idle, loop = os.environ.get("MINIKV_STEP_TRACE"), None, None  # (step_trace.py)
    if steps_path:  # written whenever the core falls idle with new steps: however the process ends later
        from minikv.engine.step_trace import StepTrace

        trace, written, loop = StepTrace(), [0], []  # each step's moment and size; the loop's turns (below)

        def on_idle() -> None:
            if len(trace.rows) > written[0]:
                Path(steps_path).write_text(json.dumps(trace.rows))
                Path(steps_path + ".loop.json").write_text(json.dumps(loop))
                written[0] = len(trace.rows)

        def on_gc(phase, info, began=[0.0]):  # noqa: B006  (the start of the collection under way)
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                loop.append(("gc", began[0], time.perf_counter(), info["generation"]))
        llm.add_observer(trace)
        gc.callbacks.append(on_gc)
    try:
        with frozen_heap():  # the model, loaded above, is never walked by a full collection (gc_pause.py)
            _serve_commands(core, view, commands, results, on_idle, loop, own_process)
    finally:
        if loop is not None:
            gc.callbacks.remove(on_gc)


class Inbox:
    """The core's commands, in the order the server sent them. Between steps the loop applies every one that
    has come. While a step forms its batch, `intake` (the core's, `EngineCore._take_arrivals`) applies the
    adds at the head of the pipe, so a request that arrived while the last step was launched runs in the very
    next one. An abort or a stop read there waits, with everything after it, for the loop after the step:
    nothing is reordered, and no request ends inside a step. Answers to adds go out as soon as they are made."""

    def __init__(self, core, commands, results, view):
        self.core, self.commands, self.results, self.view = core, commands, results, view
        self.held = None  # a command read inside a step that is not an add: the next one `get` returns
        self.answers: list[tuple] = []
        self.applied = 0  # adds applied inside steps (the loop's trace counts them)

    def get(self, timeout: float | None = 0.0):
        """The next command; queue.Empty if none came within `timeout` (0: none waiting)."""
        if self.held is not None:
            cmd, self.held = self.held, None
            return cmd
        return self.commands.get_nowait() if timeout == 0.0 else self.commands.get(timeout=timeout)

    @staticmethod
    def parts(cmd) -> tuple | list:
        """The commands one message holds: a "batch" holds several."""
        return cmd[1] if cmd[0] == "batch" else (cmd,)

    def apply(self, cmd) -> bool:
        """Apply one command (a "batch" one by one); False if it was a stop (the engine is closed then)."""
        for one in self.parts(cmd):
            if one[0] == "stop":
                self.core.close()
                self.results.put(("stopped",))
                return False
            _apply(self.core, one, self.answers)
        return True

    def send_answers(self) -> None:
        if self.answers:
            self.results.put(("answers", self.answers, self.view.snapshot()))
            self.answers = []

    def intake(self) -> None:
        """(Inside a step, before its batch is formed.) The adds waiting at the head of the pipe."""
        while self.held is None:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if any(one[0] != "add" for one in self.parts(cmd)):
                self.held = cmd
                break
            self.apply(cmd)
            self.applied += 1
        self.send_answers()


def _serve_commands(core, view, commands, results, on_idle=None, loop_trace=None, refreeze_when_idle=False) -> None:
    """Take commands, step while there is work, send each step's events, until told to stop. on_idle: called
    each time the core has no work left, before it waits for the next command. loop_trace: a list that gets
    one row per turn ("it", start, commands applied before the step, step start, end, events, adds the
    step took in itself) and one per collection ("gc", start, end, generation) (MINIKV_STEP_TRACE).
    refreeze_when_idle: after its last live request, what survived joins the frozen heap (gc_pause.refreeze:
    the prefix cache's entries outlive every request, and a full collection of the next burst would walk
    them all: 23-32 ms a collection on the GPU host after two loads, NOTES_step_profile.md)."""
    parent = mp.parent_process()
    inbox = Inbox(core, commands, results, view)
    core.intake = inbox.intake
    busy = False  # whether it stepped since it was last idle
    while True:
        try:
            if core.has_unfinished():
                cmd = inbox.get()
            else:  # idle: wait for a command (and meanwhile hand the server what the pipe could not take)
                if busy and refreeze_when_idle:
                    core.last_tokens = []  # (in-process observers' view of the last step: nobody reads it here)
                    refreeze()
                busy = False
                if on_idle is not None:
                    on_idle()
                cmd = inbox.get(timeout=FLUSH_WAIT_S if results.pending and not results.flush() else PARENT_CHECK_S)
        except queue.Empty:
            cmd = None
            if getattr(commands, "closed", False) or (parent is not None and not parent.is_alive()):
                core.close()  # the server is gone (killed), or let go of its end without a stop: so is the engine
                return
        t0, applied = time.perf_counter(), 0
        while cmd is not None:
            if not inbox.apply(cmd):
                return
            applied += 1
            try:
                cmd = inbox.get()
            except queue.Empty:
                cmd = None
        inbox.send_answers()
        t1 = time.perf_counter()
        events, failed = [], None
        if core.has_unfinished():
            busy = True
            try:
                events = core.step()
            except BaseException as e:  # noqa: BLE001  the core recovered its state; the server fails the live requests
                failed = f"{type(e).__name__}: {e}"
                events = core.take_events()
        else:
            events = core.take_events()
        if events or failed:
            results.put(("events", to_wire(events), view.snapshot(), failed))
        if loop_trace is not None:
            loop_trace.append(("it", t0, applied, t1, time.perf_counter(), len(events), inbox.applied))
            inbox.applied = 0


WireEvent = namedtuple("WireEvent", [f.name for f in fields(EngineEvent)])  # an EngineEvent's fields, read alike


def to_wire(events: list[EngineEvent]) -> list[tuple]:
    """A step's events as plain tuples (WireEvent's order): pickled in a tenth of a dataclass's time,
    on the core's side of the pipe; `from_wire` reads them back."""
    return [(e.request_id, e.index, e.token_id, e.text_delta, e.finish_reason, e.error, e.usage) for e in events]


def from_wire(events: list[tuple]) -> list[WireEvent]:
    return [WireEvent(*e) for e in events]


def _apply(core, cmd: tuple, answers: list) -> None:
    """One "add" or "abort" command; an add's answer goes to `answers`."""
    if cmd[0] == "add":
        request: EngineRequest = cmd[1]
        try:
            core.add(request)
            answers.append(("accepted", request.request_id, len(request.prompt_token_ids)))
        except ValueError as e:  # the request's fault
            answers.append(("rejected", request.request_id, str(e)))
        except BaseException as e:  # noqa: BLE001  this request fails alone
            answers.append(("add_failed", request.request_id, f"{type(e).__name__}: {e}"))
    elif cmd[0] == "abort":
        core.abort(cmd[1])


class CoreProcess:
    """Start an EngineCore in a spawned process: `LLM(model, **options)` built there (the weights
    load there, on its device). `client` then tokenizes and checks prompts here, as `LLM.request` does.
    text_in_server: the core sends token ids and the server makes the text (see the top); False: the
    core makes every request's text, as in one process."""

    def __init__(self, model, timeout: float = START_TIMEOUT_S, text_in_server: bool = True, **options):
        tokenizer = _tokenizer_of(model)  # a missing model fails here, at once, before a process starts
        self.text_in_server = text_in_server
        ctx = mp.get_context("spawn")  # CUDA cannot live in a forked child
        command_end, command_writer = ctx.Pipe(duplex=False)
        self.commands = CommandWriter(command_writer)  # see the top: neither side uses a queue
        reader, writer = ctx.Pipe(duplex=False)
        self.results = EventReader(reader)  # the core's messages
        self.process = ctx.Process(target=_core_main, args=(model, options, command_end, writer,
                                                            not text_in_server),
                                   name="minikv-core", daemon=True)
        self.process.start()
        writer.close()  # the core holds the only write end: once it is gone, the reader sees the pipe end
        command_end.close()  # and the only read end of its commands
        deadline, msg = time.monotonic() + timeout, None
        while msg is None:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():  # it may have said why just before it ended: look once more
                    try:
                        msg = self.results.get(timeout=5.0)
                        break
                    except queue.Empty:
                        pass  # died before it could say why (killed, out of memory)
                    raise RuntimeError(f"the engine process ended while starting (exit code "
                                       f"{self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"the engine process did not start within {timeout:.0f} s") from None
        if msg[0] == "start_failed":
            self.process.join(5)
            _, kind, message, trace = msg
            if kind in USER_ERRORS:  # an option or the model refused: the user's to fix
                raise USER_ERRORS[kind](message)
            raise RuntimeError(f"the engine process failed to start:\n{trace}")
        _, self.info, self.snapshot = msg
        self.tokenizer = tokenizer
        self.max_model_len = self.info.max_model_len
        self.loaded = SimpleNamespace(source=self.info.source)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, *command) -> None:
        """(Any thread.) One command, written now or, if the pipe is full, as soon as it takes it."""
        self.commands.put(command)

    def send_many(self, commands: list[tuple]) -> None:
        """Several commands as one message, taken by the core in order, all before its next step."""
        if commands:
            self.commands.put(commands[0] if len(commands) == 1 else ("batch", commands))

    def encode(self, prompt) -> tuple[list[int], str | None, str | None]:
        """(token ids, text or None, cache salt or None) of one prompt, checked here (the core checks again)."""
        ids, text, salt = parse_prompt(prompt, self.tokenizer, self.info.vocab_size)
        if len(ids) > self.info.max_model_len:
            raise ValueError(f"prompt has {len(ids):,} tokens but max_model_len is {self.info.max_model_len:,}; "
                             "raise max_model_len or shorten the prompt")
        return ids, text, salt

    def request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                tenant: str | None = None) -> EngineRequest:
        """A prompt as the core takes it."""
        ids, text, salt = self.encode(prompt)
        return EngineRequest(ids, params if params is not None else SamplingParams(), request_id, salt, text, tenant)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            deadline = time.monotonic() + timeout
            self.send("stop")
            self.commands.finish(timeout)  # (the pipe may be full of adds the core has not read yet)
            self.process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _tokenizer_of(model):
    """The tokenizer of a model, without loading its weights here."""
    from minikv.model.loader import LoadedModel, load_tokenizer, resolve

    if isinstance(model, LoadedModel):
        return model.tokenizer
    ckpt, _ = resolve(model)
    return load_tokenizer(ckpt) if ckpt is not None else None
