"""The EngineCore in a process of its own, so that HTTP, SSE and tokenizing never take its interpreter.

    server process (this one)                         core process (spawned)
    -------------------------------------------       ----------------------------------------------
    handlers tokenize, ProcessEngineLoop thread        loop: take the commands, step, send events
      submit  -> ("add", EngineRequest)   ---------->    core.add(request) -> ("accepted", id, n)
      abort   -> ("abort", request_id)    ---------->    core.abort(request_id)        or ("rejected", ...)
      stop    -> ("stop",)                ---------->    core.close()
      ("batch", [command, ...]): the commands the engine thread collected, in order, as one message
      handlers' events  <---- ("events", [event tuple, ...], Snapshot) one message per step

A burst of clients reaches the core as a few batches, not one message per request: the core takes
every command that is waiting before it steps, and one message is all there or not at all, so a
burst is not cut in two by a step that starts while the rest is still being written to the pipe
(the requests left behind would wait a whole step for their first token).

The core runs steps back to back while it has work, whatever the server is doing: a server busy
writing SSE chunks just finds several steps' events waiting and hands each client all its new
tokens in one chunk. Requests and events cross the boundary as they are (plain dataclasses,
pickled). The core sends token ids and the server's engine thread makes the text from them (a
`TextStream` per sample, minikv/engine/detokenizer.py), except for requests with stop strings, whose
text decides where they end: the core makes theirs (the detokenizer's docstring says why).

What the server reads of the engine (queues for 429/503, pool usage for /metrics) comes as a
`ViewSnapshot` (minikv/engine/view.py) with every step's events, and with every answer to a command.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import namedtuple
from dataclasses import dataclass, fields
from types import SimpleNamespace

from minikv.engine.core import EngineEvent, EngineRequest
from minikv.engine.gc_pause import frozen_heap
from minikv.engine.prompts import parse_prompt
from minikv.engine.sampling_params import SamplingParams

START_TIMEOUT_S = 600.0  # loading a large model onto a GPU may take minutes
PARENT_CHECK_S = 1.0  # an idle core looks this often whether the server that started it still lives
USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}  # the user's to fix: one line


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know of the engine it does not hold."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    source: str


def _core_main(model, options: dict, commands, results, detokenize: bool = True) -> None:
    """The core process: build the engine, then take commands and step until told to stop. With
    MINIKV_CORE_PROFILE=PATH set, the loop runs under cProfile and its stats go to PATH on stop."""
    path = os.environ.get("MINIKV_CORE_PROFILE")
    if not path:
        return _core_loop(model, options, commands, results, detokenize)
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(_core_loop, model, options, commands, results, detokenize)
    finally:
        profile.dump_stats(path)


def _core_loop(model, options: dict, commands, results, detokenize: bool) -> None:
    try:
        from minikv.engine.llm import LLM

        llm = LLM(model, **options)
        if not llm.is_paged:
            raise ValueError("the server runs the continuous-batching engine: build it with kv_backend='paged'")
        core, view = llm.core, llm.view
        core.detokenize = detokenize  # off: the server makes the text of requests without stop strings
        results.cancel_join_thread()  # from now on a server gone mid-load must not keep this process alive
        results.put(("ready", CoreInfo(core.max_model_len, llm.config.vocab_size, view.num_blocks,
                                       view.block_size, str(llm.loaded.source)), view.snapshot()))
    except BaseException as e:  # noqa: BLE001  the server says why and exits
        results.put(("start_failed", type(e).__name__, str(e), traceback.format_exc()))
        return
    with frozen_heap():  # the model, loaded above, is never walked by a full collection (gc_pause.py)
        _serve_commands(core, view, commands, results)


def _serve_commands(core, view, commands, results) -> None:
    """Take commands, step while there is work, send each step's events, until told to stop."""
    parent = mp.parent_process()
    while True:
        try:
            cmd = commands.get(timeout=PARENT_CHECK_S) if not core.has_unfinished() else commands.get_nowait()
        except queue.Empty:
            cmd = None
            if parent is not None and not parent.is_alive():  # the server is gone (killed): so is its engine
                core.close()
                return
        answers = []
        while cmd is not None:
            for one in cmd[1] if cmd[0] == "batch" else (cmd,):
                if one[0] == "stop":
                    core.close()
                    results.put(("stopped",))
                    return
                _apply(core, one, answers)
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                cmd = None
        if answers:
            results.put(("answers", answers, view.snapshot()))
        events, failed = [], None
        if core.has_unfinished():
            try:
                events = core.step()
            except BaseException as e:  # noqa: BLE001  the core recovered its state; the server fails the live requests
                failed = f"{type(e).__name__}: {e}"
                events = core.take_events()
        else:
            events = core.take_events()
        if events or failed:
            results.put(("events", to_wire(events), view.snapshot(), failed))


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
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_core_main, args=(model, options, self.commands, self.results,
                                                            not text_in_server),
                                   name="minikv-core", daemon=True)
        self.process.start()
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
            self.send("stop")
            self.process.join(timeout)
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
