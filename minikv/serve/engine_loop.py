"""One engine loop owns the LLM; request handlers submit to it and get their tokens back as events.

    HTTP handlers (asyncio, any number)            engine thread (one)
    ------------------------------------           ---------------------------------------------
    submit(prompt, params, tenant, on_event) --->  commands queue --> llm.add_request(...)
    abort(request_id)                        --->                 --> llm.abort(seq): blocks freed now
                                                   loop: llm.step(); for every live request, the
    on_event(Event)   <-------------------------   tokens and text it got since the last step

Only the engine thread runs the LLM (scheduling, the model); handlers tokenize before they submit,
so a long prompt never stalls the step loop. A handler never waits for a step: it puts a command on a
queue and awaits its own events, so a slow step never blocks the HTTP server, and a client that goes
away has its request aborted between two steps.

Failures stay as small as they can: a request the engine refuses fails alone (its handler hears
"rejected" or "failed"); a step that raises fails the requests that were live, and the loop goes on.
Should the loop itself end (a bug), every live and queued request hears "failed", later submits fail
at once, and `on_death` callbacks run (the server stops): no client is left waiting.
"""
from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from minikv.engine.fork import samples_of
from minikv.engine.gc_pause import frozen_heap
from minikv.engine.llm import LLM, Prompt
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence

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


@dataclass
class _Live:
    seq: Sequence
    on_event: Callable[[Event], None]
    tenant: str
    sent: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # sample -> (tokens, chars, finished)


class EngineLoop:
    """metrics: a ServerMetrics (minikv/serve/metrics.py) told about every finished request, or None."""

    def __init__(self, llm: LLM, metrics=None, idle_wait: float = 0.05):
        if not llm.is_paged:
            raise ValueError("the server runs the continuous-batching engine: build the LLM with kv_backend='paged'")
        self.llm = llm
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
        self._stop_observing = llm.add_observer(self)  # until the loop ends: then the engine may go
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

    def num_queued(self, tenant: str | None = None) -> int:
        """Requests not running yet: queued in the scheduler, or submitted and not yet queued (of one
        tenant, if given). Some of them may be about to take a free seat: see num_waiting."""
        if tenant is None:
            return len(self.llm.scheduler.waiting) + self._pending
        return self._waiting_by_tenant[tenant] + self._pending_by_tenant[tenant]

    def free_seats(self) -> int:
        """Seats (max_num_seqs) that no running, swapped-out or loading request holds."""
        sch = self.llm.scheduler
        return max(0, sch.max_num_seqs - len(sch.running) - len(sch.swapped) - len(sch.loading))

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
        self._waiting_by_tenant = Counter(s.root.tenant or "" for s in self.llm.scheduler.waiting)

    def _run(self) -> None:
        try:
            with frozen_heap():  # what lived at start-up (the model, the tokenizer) is never walked by a full collection
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
            if self.llm.has_unfinished():
                try:
                    self.llm.step()
                except BaseException as e:  # noqa: BLE001  the engine recovered its state; its requests end
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(e)
                    continue
                self.num_steps += 1
                self._recount_waiting()
                self._publish()
            else:
                self._wake.wait(self.idle_wait)
                self._wake.clear()

    def _close(self) -> None:
        """No more submits; every queued and live request hears why."""
        e = self.error
        closed = RuntimeError("the server is shutting down" if e is None else
                              f"the engine loop ended ({type(e).__name__}: {e}); the server stops")
        with self._pending_lock:
            self._closed = closed
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
                return
            if cmd[0] == "submit":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])

    def _add(self, prompt, params, tenant, request_id, on_event) -> None:
        seq = error = None
        try:
            seq = self.llm.add_request(prompt, params, request_id=request_id, tenant=tenant)
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
        self._live[request_id] = _Live(seq, on_event, tenant)
        if not _tell(on_event, Event("accepted", prompt_tokens=seq.num_prompt_tokens)):
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:  # already finished
            return
        self.llm.abort(live.seq)
        if self.metrics is not None:
            self.metrics.request_done(live.tenant, live.seq, "abort")

    def _publish(self) -> None:
        """Hand every live request what it got this step; retire the ones that ended."""
        for rid, live in list(self._live.items()):
            try:
                self._publish_one(rid, live)
            except BaseException as e:  # noqa: BLE001  this request fails; the others go on
                log.error("request %s failed while its tokens were handed over:\n%s", rid, traceback.format_exc())
                if self._live.pop(rid, None) is not None:
                    self._end_failed(live, e)

    def _publish_one(self, rid: str, live: _Live) -> None:
        for s in samples_of(live.seq):
            tokens, chars, finished = live.sent.get(s.index, (0, 0, False))
            if finished or (len(s.output_token_ids) == tokens and not s.is_finished):
                continue
            new_ids = s.output_token_ids[tokens:]
            if self.metrics is not None and new_ids:  # counted before the client can see them
                self.metrics.tokens_generated(live.tenant, len(new_ids))
            live.sent[s.index] = (len(s.output_token_ids), len(s.text), s.is_finished)
            if not _tell(live.on_event, Event("tokens", s.index, list(new_ids), s.text[chars:],
                                              s.finish_reason if s.is_finished else None)):
                self._abort(rid)  # nobody listens any more
                return
        root = live.seq
        if root.num_pending_forks or not all(s.is_finished for s in samples_of(root)):
            return
        del self._live[rid]
        samples = samples_of(root)
        errors = [s for s in samples if s.finish_reason == "error"]
        if self.metrics is not None:
            self.metrics.request_done(live.tenant, root, root.finish_reason or "stop")
        if errors:
            _tell(live.on_event, Event("failed", error=RuntimeError(errors[0].error)))
            return
        _tell(live.on_event, Event("end", prompt_tokens=root.num_prompt_tokens,
                                   completion_tokens=sum(len(s.output_token_ids) for s in samples),
                                   cached_tokens=root.num_cached_tokens))

    def _fail_all(self, error: BaseException) -> None:
        for rid, live in list(self._live.items()):
            del self._live[rid]
            self._end_failed(live, error)

    def _end_failed(self, live: _Live, error: BaseException) -> None:
        try:
            self.llm.abort(live.seq)
        except BaseException:  # noqa: BLE001  best effort: the engine may be the thing that broke
            pass
        try:
            if self.metrics is not None:
                self.metrics.request_done(live.tenant, live.seq, "error")
        except BaseException:  # noqa: BLE001
            log.error("metrics failed for a failed request:\n%s", traceback.format_exc())
        _tell(live.on_event, Event("failed", error=error))


def _tell(on_event: Callable[[Event], None], event: Event) -> bool:
    """Hand a handler its event; False if it cannot hear it (its event loop closed): a listener's
    error never reaches the engine loop."""
    try:
        on_event(event)
        return True
    except BaseException:  # noqa: BLE001
        log.warning("a request's handler could not be told %r:\n%s", event.kind, traceback.format_exc())
        return False
