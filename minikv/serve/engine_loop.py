"""One engine loop drives the EngineCore; request handlers submit to it and get their events back.

    HTTP handlers (asyncio, any number)            engine thread (one)
    ------------------------------------           ---------------------------------------------
    submit(prompt, params, tenant, on_event) --->  commands queue --> core.add(request)
    abort(request_id)                        --->                 --> core.abort(request_id): blocks freed now
                                                   loop: events = core.step(); each request's
    on_event(Event)   <-------------------------   events of the step, grouped per sample

The server is a client of the core's events (minikv/engine/core.py), as `LLM.generate` is: the token
ids, text deltas and usage come from the core; nothing is worked out again here (behind an engine
process, the text of requests without stop strings is made on this side by the detokenizer's own
`TextStream` from the ids: see ProcessEngineLoop). Only the engine
thread runs the core (scheduling, the model); handlers tokenize before they submit, so a long
prompt never stalls the step loop. A handler never waits for a step: it puts a command on a queue
and awaits its own events, so a slow step never blocks the HTTP server, and a client that goes away
has its request aborted between two steps.

Failures stay as small as they can: a request the engine refuses fails alone (its handler hears
"rejected" or "failed"); a step that raises fails the requests that were live, and the loop goes on.
Should the loop itself end (a bug), every live and queued request hears "failed", later submits fail
at once, and `on_death` callbacks run (the server stops): no client is left waiting.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import queue
import threading
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from minikv.engine.core import EngineEvent, Usage
from minikv.engine.detokenizer import TextStream, fast_decoder, text_in_core
from minikv.engine.gc_pause import frozen_heap
from minikv.engine.llm import LLM, Prompt
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.view import ViewSnapshot
from minikv.serve.core_process import FLUSH_WAIT_S, from_wire

log = logging.getLogger("minikv.serve")


@dataclass
class Event:
    """What a handler hears about its request.

    kind "accepted"  the engine queued it (prompt_tokens set)
         "rejected"  the engine refused it (error: the ValueError, e.g. a prompt over max_model_len)
         "tokens"    sample `index` got `token_ids` / `text` since the last event; finish_reason when it ended
         "end"       every sample ended (usage fields set)
         "failed"    the engine hit an error while running it (error set); nothing follows
    """

    kind: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: Exception | None = None
    usage: Usage | None = None  # "end": the core's own record (its arrival and token times: the trace)


@dataclass
class _Live:
    on_event: Callable[[Event], None]
    tenant: str
    quiet: bool = False  # its handler is gone or already told: its last events only count in the metrics
    error: str | None = None  # a sample ended with finish_reason "error": why
    reason: str | None = None  # how its first sample ended
    texts: dict[int, TextStream] | None = None  # its samples' text, made here from the token ids (the core
    #   sends ids only: ProcessEngineLoop), or None: the core's text deltas


@dataclass
class _StepOf:
    """One request's events of one step, per sample: (token ids, text pieces, [finish reason, error])."""

    samples: dict[int, tuple[list[int], list[str], list[str | None]]] = field(default_factory=dict)
    usage: Usage | None = None


class EngineLoop:
    """metrics: a ServerMetrics (minikv/serve/metrics.py) told about every finished request, or None."""

    def __init__(self, llm: LLM, metrics=None, idle_wait: float = 0.05):
        if not llm.is_paged:
            raise ValueError("the server runs the continuous-batching engine: build the LLM with kv_backend='paged'")
        self.llm = llm
        self.core, self.view = llm.core, llm.view
        self._init_loop(metrics, idle_wait)
        self._stop_observing = llm.add_observer(self)  # until the loop ends: then the engine may go

    def _init_loop(self, metrics, idle_wait: float) -> None:
        self.metrics = metrics
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, _Live] = {}
        self._pending = 0  # submitted, not yet queued in the engine
        self._pending_by_tenant: Counter[str] = Counter()
        self._pending_lock = threading.Lock()
        self._waiting_by_tenant: Counter[str] = Counter()  # queued in the scheduler: +1 on submit, recounted
        #   as soon as a step's batch is picked (a request admitted then no longer waits, though the step
        #   that runs it, a long prefill say, has not finished) and again after the step
        self._stop_observing: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._run, name="minikv-engine", daemon=True)
        self._closed: Exception | None = None  # set (under _pending_lock) once no submit can be served
        self.error: BaseException | None = None  # what ended the loop, if it was not stop()
        self.on_death: list[Callable[[BaseException], None]] = []
        self.num_steps = 0
        self.num_aborts_asked = 0  # abort() calls: handlers whose client went away

    # ---- called from any thread -----------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and self._closed is None

    def submit(self, prompt: Prompt, params: SamplingParams, tenant: str, request_id: str,
               on_event: Callable[[Event], None]) -> None:
        """Queue a request; `on_event` is called (on the engine thread) with its events, in order. Once
        the loop has ended, it is called at once with "failed"."""
        with self._pending_lock:
            closed = self._closed
            if closed is None:
                self._pending += 1
                self._pending_by_tenant[tenant] += 1
                self._commands.put(("submit", prompt, params, tenant, request_id, on_event))
        if closed is not None:
            _tell(on_event, Event("failed", error=closed))
            return
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away); its blocks go back before the next step."""
        self.num_aborts_asked += 1
        self._commands.put(("abort", request_id))
        self._wake.set()

    def snapshot(self) -> ViewSnapshot:
        """The engine's numbers the server reads (/metrics), now."""
        return self.view.snapshot()

    def num_queued(self, tenant: str | None = None) -> int:
        """Requests not running yet: queued in the scheduler, or submitted and not yet queued (of one
        tenant, if given). Some of them may be about to take a free seat: see num_waiting."""
        if tenant is None:
            return len(self.view.waiting) + self._pending
        return self._waiting_by_tenant[tenant] + self._pending_by_tenant[tenant]

    def free_seats(self) -> int:
        """Seats (max_num_seqs) that no running, swapped-out or loading request holds."""
        return self.view.free_seats

    def num_waiting(self, tenant: str | None = None) -> int:
        """Queued requests that will not get a seat at the next step: those beyond the free seats.

            queued:  r1 r2 r3 r4 r5 r6        free seats: 4
                     [-- seated next --][wait]   -> 2 waiting

        For one tenant, as if its requests were first in line (a flood of its own still counts)."""
        return max(0, self.num_queued(tenant) - self.free_seats())

    # ---- the engine thread ----------------------------------------------------------------------
    def on_schedule(self, llm: LLM, batch) -> None:
        """(An engine observer.) The batch is picked: count who still waits."""
        self._recount_waiting()

    def _recount_waiting(self) -> None:
        self._waiting_by_tenant = Counter(s.root.tenant or "" for s in self.view.waiting)

    def _run(self) -> None:
        try:
            # what lived at start-up (the model, the tokenizer) is never walked by a full collection
            with frozen_heap():
                self._loop()
        except BaseException as e:  # noqa: BLE001  a bug in the loop itself: nobody may be left waiting
            log.critical("the engine loop ended:\n%s", traceback.format_exc())
            self.error = e
        finally:
            self._close()
        if self.error is not None:
            for callback in list(self.on_death):
                callback(self.error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            if self.core.has_unfinished():
                try:
                    events = self.core.step()
                except BaseException as e:  # noqa: BLE001  the engine recovered its state; its requests end
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(e)
                    continue
                self.num_steps += 1
                self._recount_waiting()
                self._publish(events)
            else:
                self._wake.wait(self.idle_wait)
                self._wake.clear()

    def _mark_closed(self) -> RuntimeError:
        """From now on a submit fails at once; what it hears."""
        e = self.error
        closed = RuntimeError("the server is shutting down" if e is None else
                              f"the engine loop ended ({type(e).__name__}: {e}); the server stops")
        with self._pending_lock:
            self._closed = closed
        return closed

    def _close(self) -> None:
        """No more submits; every queued and live request hears why."""
        closed = self._mark_closed()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "submit":
                _tell(cmd[5], Event("failed", error=closed))
        self._fail_all(closed)
        self._stop_observing()  # no cycle engine -> observers -> loop -> engine outlives the loop
        self._stop_observing = lambda: None

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "submit":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])
        ended = self.core.take_events()  # what the aborts ended
        if ended:
            self._publish(ended)

    def _add(self, prompt, params, tenant, request_id, on_event) -> None:
        seq = error = None
        try:
            seq = self.core.add(self.llm.request(prompt, params, request_id, tenant))
        except ValueError as e:  # the request's fault: its handler answers 400
            error = e
        except BaseException as e:  # noqa: BLE001  any other error fails this request alone
            log.error("the engine could not take request %s:\n%s", request_id, traceback.format_exc())
            error = RuntimeError(f"the engine could not take this request ({type(e).__name__}: {e})")
        with self._pending_lock:  # queued (if accepted) before its handler hears about it
            self._pending -= 1
            self._pending_by_tenant[tenant] -= 1
            if not self._pending_by_tenant[tenant]:  # a tenant with nothing pending takes no memory
                del self._pending_by_tenant[tenant]
            if seq is not None:
                self._waiting_by_tenant[tenant] += 1
        if seq is None:
            _tell(on_event, Event("rejected" if isinstance(error, ValueError) else "failed", error=error))
            return
        self._live[request_id] = _Live(on_event, tenant)
        if not _tell(on_event, Event("accepted", prompt_tokens=seq.num_prompt_tokens)):
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        """Its handler is gone: the core stops it; its last events (usage) only reach the metrics."""
        live = self._live.get(request_id)
        if live is None:  # already finished
            return
        live.quiet, live.reason = True, "abort"
        self.core.abort(request_id)

    def _publish(self, events: list[EngineEvent]) -> None:
        """Hand every request what it got in these events; retire the ones that ended."""
        steps: dict[str, _StepOf] = {}
        for e in events:
            live = self._live.get(e.request_id)
            if live is None:
                continue  # a request this loop does not serve (or no longer)
            step = steps.setdefault(e.request_id, _StepOf())
            ids, text, end = step.samples.setdefault(e.index, ([], [], [None, None]))
            if e.token_id is not None:
                ids.append(e.token_id)
            if live.texts is None:
                text.append(e.text_delta)
            elif not live.quiet:  # nobody reads a quiet request's text
                stream = live.texts.get(e.index)
                if stream is None:
                    stream = live.texts[e.index] = TextStream(self._decoder)
                text.append(stream.add(e.token_id, e.finish_reason))
            if e.finish_reason is not None:
                end[:] = [e.finish_reason, e.error]
            if e.usage is not None:
                step.usage = e.usage
        for rid, step in steps.items():
            live = self._live.get(rid)
            if live is None:
                continue
            try:
                self._publish_one(rid, live, step)
            except BaseException as e:  # noqa: BLE001  this request fails; the others go on
                log.error("request %s failed while its tokens were handed over:\n%s", rid, traceback.format_exc())
                if not live.quiet:
                    self._end_failed(rid, live, e)

    def _publish_one(self, rid: str, live: _Live, step: _StepOf) -> None:
        for index, (ids, text, (reason, error)) in sorted(step.samples.items()):
            if reason == "error" and live.error is None:
                live.error = error or "the request failed"
            if index == 0 and reason is not None and live.reason is None:
                live.reason = reason
            if live.quiet:
                continue
            if self.metrics is not None and ids:  # counted before the client can see them
                self.metrics.tokens_generated(live.tenant, len(ids))
            if not _tell(live.on_event, Event("tokens", index, ids, "".join(text), reason)):
                self._abort(rid)  # nobody listens any more
        if step.usage is None:
            return
        del self._live[rid]
        if self.metrics is not None:
            self.metrics.request_done(live.tenant, step.usage, "error" if live.error else live.reason or "stop")
        if live.quiet:
            return
        if live.error:
            _tell(live.on_event, Event("failed", error=RuntimeError(live.error)))
            return
        u = step.usage
        _tell(live.on_event, Event("end", prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                   cached_tokens=u.cached_tokens, usage=u))

    def _fail_all(self, error: BaseException) -> None:
        for rid, live in list(self._live.items()):
            if not live.quiet:
                self._end_failed(rid, live, error)
        try:
            self._publish(self.core.take_events())  # their last events: the metrics count them
        except BaseException:  # noqa: BLE001  the loop's own code may be what broke: every handler is told already
            log.error("the failed requests' last events could not be counted:\n%s", traceback.format_exc())
            self._live.clear()

    def _end_failed(self, rid: str, live: _Live, error: BaseException) -> None:
        """Tell the handler its request failed; the core stops it (its usage still reaches the metrics)."""
        live.quiet, live.error = True, live.error or str(error)
        _tell(live.on_event, Event("failed", error=error))
        try:
            self.core.abort(rid)
        except BaseException:  # noqa: BLE001  best effort: the engine may be the thing that broke
            log.error("the engine could not abort failed request %s:\n%s", rid, traceback.format_exc())
            self._live.pop(rid, None)


class ProcessEngineLoop(EngineLoop):
    """The same loop with the EngineCore in its own process (minikv/serve/core_process.py): a submit
    sends its request to the core from the submitting thread (a handler's, on the event loop: see
    core_process.py's top for why not through this thread); this thread forwards aborts and hands each
    handler its events as they arrive; the core steps back to back in the other process, so HTTP, SSE
    and tokenizing never slow a step. Unless the core makes the text (CoreProcess(text_in_server=False)),
    this thread makes it from the token ids, for every request without stop strings
    (minikv/engine/detokenizer.py says why)."""

    def __init__(self, proc, metrics=None, idle_wait: float = 0.05):
        self.proc = proc
        self.llm = proc  # what the handlers read: tokenizer, max_model_len, encode, loaded.source
        self.core = _RemoteCore(self)
        self._snapshot: ViewSnapshot = proc.snapshot
        self._submitted: dict[str, tuple[Callable[[Event], None], str, bool]] = {}  # sent, not yet answered:
        #   (on_event, tenant, whether its text is made here)
        self._gone: set[str] = set()  # sent, then aborted before the core answered
        self._outgoing: list[tuple] | None = None  # commands collected by a drain, sent as one message
        self._decoder = fast_decoder(proc.tokenizer) if proc.tokenizer is not None else None
        self._init_loop(metrics, idle_wait)
        self._wake = _PipeWake()  # an abort wakes this thread at once, whether it waits for the core or not

    def snapshot(self) -> ViewSnapshot:
        return self._snapshot

    def num_queued(self, tenant: str | None = None) -> int:
        if tenant is None:
            return self._snapshot.num_waiting + self._pending
        return self._waiting_by_tenant[tenant] + self._pending_by_tenant[tenant]

    def free_seats(self) -> int:
        return self._snapshot.free_seats

    def _recount_waiting(self) -> None:
        self._waiting_by_tenant = Counter(self._snapshot.waiting_by_tenant)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self.proc.stop()

    def submit(self, prompt: Prompt, params: SamplingParams, tenant: str, request_id: str,
               on_event: Callable[[Event], None]) -> None:
        """Check the request and send it to the core now, from this thread (not the engine thread's):
        `on_event` hears "rejected" at once if it is refused here, "failed" if the loop has ended."""
        try:
            request = self.proc.request(prompt, params, request_id, tenant)
        except ValueError as e:  # the request's fault: its handler answers 400
            _tell(on_event, Event("rejected", error=e))
            return
        text_here = (self.proc.text_in_server and self.proc.tokenizer is not None
                     and not text_in_core(request.params))
        with self._pending_lock:  # counted and known before the core can answer, or refused: never lost
            closed = self._closed
            if closed is None:
                self._pending += 1
                self._pending_by_tenant[tenant] += 1
                self._submitted[request_id] = (on_event, tenant, text_here)
        if closed is not None:
            _tell(on_event, Event("failed", error=closed))
            return
        try:
            self.proc.send("add", request)
        except BaseException as e:  # noqa: BLE001  (it could not be pickled, say): this request fails alone
            log.error("request %s could not be sent to the engine process:\n%s", request_id, traceback.format_exc())
            with self._pending_lock:
                sent = self._submitted.pop(request_id, None)
            if sent is not None:
                self._answered("add_failed", request_id, f"{type(e).__name__}: {e}", sent)

    def _loop(self) -> None:
        results = self.proc.results.conn  # the core's pipe (core_process.py), waited on with the aborts' wake
        commands = self.proc.commands  # what the command pipe could not take yet goes on each turn
        while not self._stop.is_set():
            self._drain()
            flushed = not commands.pending or commands.flush()
            ready = mp_connection.wait([results, self._wake.reader],
                                       timeout=self.idle_wait if flushed else FLUSH_WAIT_S)
            self._wake.clear()  # (the commands it announced are drained at the top of the next turn)
            try:
                msg = self.proc.results.get_nowait() if results in ready else None
            except queue.Empty:
                msg = None
            if msg is None:
                if not self.proc.alive:
                    raise RuntimeError(f"the engine process ended (exit code {self.proc.process.exitcode})") from None
                continue
            steps: list[tuple] = []  # every step already here is handed over at once: a busy server catches up
            while msg is not None:
                if msg[0] == "events":
                    steps.append(msg)
                else:
                    self._handle_steps(steps)
                    steps = []
                    self._handle(msg)
                try:
                    msg = self.proc.results.get_nowait()
                except queue.Empty:
                    msg = None
            self._handle_steps(steps)

    def _drain(self) -> None:
        """Every waiting abort goes to the core in one message."""
        self._outgoing = []
        try:
            super()._drain()
        finally:
            out, self._outgoing = self._outgoing, None
            self.proc.send_many(out)

    def send_command(self, *command) -> None:
        """("add", request) or ("abort", request_id) for the core process: gathered while a drain is under
        way (one message per drain), sent at once otherwise."""
        if self._outgoing is not None:
            self._outgoing.append(command)
        else:
            self.proc.send(*command)

    def _handle_steps(self, steps: list[tuple]) -> None:
        """Several steps' messages as one: each request hears all its new tokens in one event."""
        if not steps:
            return
        if len(steps) == 1 or any(m[3] is not None for m in steps):  # a failed step: each in its order
            for m in steps:
                self._handle(m)
            return
        self._handle(("events", [e for m in steps for e in m[1]], steps[-1][2], None))
        self.num_steps += len(steps) - 1

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "answers":
            self._snapshot = msg[2]
            for answer, rid, detail in msg[1]:
                self._answered(answer, rid, detail)
            self._recount_waiting()
        elif kind == "events":
            _, events, self._snapshot, failed = msg
            self.num_steps += 1
            self._recount_waiting()
            if failed is not None:  # the core recovered; its live requests end, as in one process
                log.error("engine step failed in the engine process: %s", failed)
                self._fail_all(RuntimeError(failed))
            self._publish(from_wire(events))
        elif kind == "stopped":
            raise RuntimeError("the engine process stopped")

    def _abort(self, request_id: str) -> None:
        if request_id in self._submitted:  # the core has it (or soon will): it stops it, in order
            self._gone.add(request_id)
            self.core.abort(request_id)
            return
        super()._abort(request_id)

    def _answered(self, answer: str, rid: str, detail, sent=None) -> None:
        on_event, tenant, text_here = sent if sent is not None else self._submitted.pop(rid)
        gone = rid in self._gone
        self._gone.discard(rid)
        with self._pending_lock:
            self._pending -= 1
            self._pending_by_tenant[tenant] -= 1
            if not self._pending_by_tenant[tenant]:
                del self._pending_by_tenant[tenant]
            if answer == "accepted":
                self._waiting_by_tenant[tenant] += 1
        if answer != "accepted":
            error = ValueError(detail) if answer == "rejected" else RuntimeError(
                f"the engine could not take this request ({detail})")
            _tell(on_event, Event("rejected" if answer == "rejected" else "failed", error=error))
            return
        self._live[rid] = _Live(on_event, tenant, quiet=gone, reason="abort" if gone else None,
                                texts={} if text_here else None)
        if not gone and not _tell(on_event, Event("accepted", prompt_tokens=detail)):
            self._abort(rid)

    def _close(self) -> None:
        closed = self._mark_closed()  # first: a submit either fails at once or is among these
        with self._pending_lock:
            submitted, self._submitted = list(self._submitted.values()), {}
            for _, tenant, _ in submitted:  # no longer pending: none will be answered
                self._pending -= 1
                self._pending_by_tenant[tenant] -= 1
            self._pending_by_tenant = +self._pending_by_tenant  # (a Counter without its zeros)
        for on_event, *_ in submitted:
            _tell(on_event, Event("failed", error=closed))
        super()._close()


class _PipeWake:
    """threading.Event's set() and clear() for a thread that waits on pipes: the engine thread waits for
    the core's messages and for aborts (and stop) at once (multiprocessing.connection.wait on both). An
    abort that only set an Event would wait for the next message from the core: up to idle_wait when the
    core is idle, a whole step when it is busy, before it even reached the core."""

    def __init__(self):
        self.reader, self._writer = mp.Pipe(duplex=False)
        self._lock = threading.Lock()
        self._set = False

    def set(self) -> None:
        with self._lock:
            if not self._set:  # one byte in the pipe at most
                self._set = True
                self._writer.send_bytes(b"")

    def clear(self) -> None:
        with self._lock:
            if self._set:
                self._set = False
                while self.reader.poll():
                    self.reader.recv_bytes()


class _RemoteCore:
    """What the loop asks of a core, sent to the core process."""

    def __init__(self, loop: ProcessEngineLoop):
        self.loop = weakref.ref(loop)  # the loop owns its core, not the other way

    def abort(self, request_id: str) -> None:
        loop = self.loop()
        if loop is not None:
            loop.send_command("abort", request_id)

    def take_events(self) -> list:
        return []  # they come with the step messages

    def has_unfinished(self) -> bool:
        return True


def _tell(on_event: Callable[[Event], None], event: Event) -> bool:
    """Hand a handler its event; False if it cannot hear it (its event loop closed): a listener's
    error never reaches the engine loop."""
    try:
        on_event(event)
        return True
    except BaseException:  # noqa: BLE001
        log.warning("a request's handler could not be told %r:\n%s", event.kind, traceback.format_exc())
        return False
