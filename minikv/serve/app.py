"""The HTTP server: the OpenAI API over one engine loop (FastAPI + uvicorn).

    POST /v1/completions         prompt (text or token ids)        -> text_completion (or a stream)
    POST /v1/chat/completions    messages, through the chat template -> chat.completion (or a stream)
    GET  /v1/models              the served model
    GET  /health                 200 while the engine loop runs
    GET  /metrics                Prometheus text (minikv/serve/metrics.py)

A stream is server-sent events, one `data: {chunk}` per engine step that gave the request tokens
(the last content chunk of a sample carries its finish_reason), then `data: [DONE]`: always, an
error included (`data: {"error": ...}` first). With stream_options.include_usage, a chunk with
no choices and the usage comes just before [DONE].

Tenants (minikv/serve/tenants.py): a keyed hash of the API key (`Authorization: Bearer KEY`), never
the key itself. With isolate_tenants, each tenant's prompts are salted with its id, so two tenants
never share a cached block (nor learn, from a fast first token, what the other sent), and only the
credential names the tenant.

With MINIKV_SERVE_TRACE=PATH set, every streamed request that ends adds one JSON line to PATH, the
moments (time.perf_counter, one clock for every process of a Linux host) its first token went through:

    handler      its handler started (the request's headers were in)
    arrival      the engine took it (the core's clock)          first_token  the engine sampled its first token
    first_sent   the handler handed its first chunk over, to be written to the socket

so a slow first token is found where it waited: before the engine, in it, or on the way back
(`minikv.bench.serve.ttft_parts`; benchmarks/ratios_gpu.py records them).

A request's life in a handler, before the engine sees it:

    body (<= max_body_bytes, else 413) -> JSON -> checked fields (400) -> tenant, queue limits (429/503)
    -> chat template + tokenizer on a worker thread, length checked (400) -> engine.submit(token ids)

so a huge or malformed request costs its own handler, never the engine thread nor the other streams.
A prompt already in token ids skips the worker thread (its check is two C loops: a thread hop would
cost more than the work), so a burst of such requests reaches the engine as fast as it is parsed;
the engine's events come back through a `Mailbox`, one wake-up of the event loop per batch.

    server = Server(LLM("tiny-random", kv_backend="paged"), port=0).start()   # a thread, a free port
    openai.OpenAI(base_url=server.url + "/v1", api_key="alice").completions.create(...)
    server.stop()
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minikv.engine.llm import LLM
from minikv.serve.app_thread import AppThread
from minikv.serve.engine_loop import EngineLoop, Event, ProcessEngineLoop
from minikv.serve.metrics import ServerMetrics
from minikv.serve.protocol import ApiError, Parsed, choice, envelope, new_id, now, parse_request, usage
from minikv.serve.tenants import Tenants

log = logging.getLogger("minikv.serve")
DEFAULT_MAX_WAITING = 256  # requests queued for a seat before the server answers 503 (Retry-After)
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a request body over this gets 413 (--max-body-bytes)
POLL_DISCONNECT_S = 0.25  # how often a non-streaming handler checks that its client is still there
TOKENIZER_THREADS = 2  # handlers tokenize here, never on the engine thread
TRACE_ENV = "MINIKV_SERVE_TRACE"  # a path: where each streamed request's first-token moments go (see the top)


def describe(error: BaseException | None) -> str:
    """An engine error for a client: its words, and its type unless it is the engine's own RuntimeError."""
    return str(error) if type(error) is RuntimeError else f"{type(error).__name__}: {error}"


def error_response(e: ApiError) -> Response:
    return Response(e.json(), status_code=e.status, headers=e.headers, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to be over `limit` bytes."""
    def too_large(size: str) -> ApiError:
        return ApiError(413, f"the request body ({size} bytes) is over this server's limit of {limit:,} bytes; "
                             "send a shorter prompt, or start the server with a larger --max-body-bytes",
                        type="invalid_request_error", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared):,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"{size:,} so far")
        chunks.append(chunk)
    return b"".join(chunks)


def max_token_bytes(tokenizer) -> int:
    """The longest token's text in UTF-8 bytes: a text of more than max_model_len times this (with a
    margin for normalizers) has more than max_model_len tokens, known without tokenizing it."""
    if tokenizer is None:
        return 0
    try:
        return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001  a tokenizer without a vocabulary to read: no early check
        return 0


class Mailbox:
    """Events from the engine thread to the server's event loop, handed over in batches: the first event
    of a batch wakes the loop (call_soon_threadsafe writes to a pipe, tens of microseconds of the engine
    thread's time), the events the engine thread puts while it is awake ride along. A step's events for
    256 streams cost one wake-up, not 256."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Event]] = []

    def put(self, events: asyncio.Queue, event: Event) -> None:
        """(Any thread.) Raises RuntimeError once the loop is closed, as call_soon_threadsafe does."""
        if self.loop.is_closed():
            raise RuntimeError("the server's event loop is closed")
        with self._lock:
            self._items.append((events, event))
            if len(self._items) > 1:  # a wake-up is on its way and will take this one too
                return
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for events, event in items:
            events.put_nowait(event)


class AppDeps:
    """What the routes of one app reach: the engine loop (and through it the LLM or the engine process),
    the metrics, the tenants, the tokenizer threads. `release()` (when the server stops) lets go of them,
    so a stopped server keeps no engine alive."""

    def __init__(self, engine: EngineLoop, tenants: Tenants, tokenizer_pool: ThreadPoolExecutor):
        self.engine, self.llm, self.metrics = engine, engine.llm, engine.metrics
        self.tenants, self.tokenizer_pool = tenants, tokenizer_pool

    def release(self) -> None:
        self.tokenizer_pool.shutdown(wait=True)  # no handler runs any more: its threads end now
        self.engine = self.llm = self.metrics = None


def build_app(engine: EngineLoop, served_name: str, isolate_tenants: bool = False,
              max_waiting: int = DEFAULT_MAX_WAITING, max_waiting_per_tenant: int | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tenants: Tenants | None = None,
              before_submit=None, stream_interval: int = 1) -> FastAPI:
    """max_waiting: requests waiting for a seat (beyond the free seats) before anyone gets 503.
    max_waiting_per_tenant: before that tenant gets 429 (so a flood is refused to the tenant who
    floods, not to everyone). max_body_bytes: a larger body gets 413. tenants: who sent a request
    (minikv/serve/tenants.py; a fresh key if None). before_submit: `await before_submit(headers, ids,
    salt)` once a request is tokenized, before the engine sees it (a decode engine takes the prompt's
    KV blocks from a prefill engine there: minikv/serve/disagg.py). stream_interval: a stream's chunk waits
    until it holds this many new tokens (the first token and the end go at once): fewer, fuller chunks, so
    fewer writes to the sockets, which is most of a busy server's own work per token."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
        raise ValueError(f"stream_interval must be a whole number of tokens, at least 1 (1: every token as it "
                         f"comes), got {stream_interval!r}")
    tenants = tenants or Tenants(isolate=isolate_tenants)
    app = FastAPI(title="minikv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tenants = tenants
    created = now()
    # what the routes reach, held in one place: `app.state.deps.release()` lets go of the engine (FastAPI
    # caches route functions in module-level caches, so nothing the routes close over may be the engine)
    deps = app.state.deps = AppDeps(engine, tenants, ThreadPoolExecutor(TOKENIZER_THREADS,
                                                                        thread_name_prefix="minikv-tokenize"))
    text_limit = 4 * max_token_bytes(deps.llm.tokenizer) * deps.llm.max_model_len  # bytes of text that surely overflow
    trace_path = os.environ.get(TRACE_ENV)
    admitting: Counter[str] = Counter()  # past the queue limits, not yet submitted (tokenizing): they count
    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}  # one per event loop serving the app

    def mailbox() -> Mailbox:
        loop = asyncio.get_running_loop()
        box = mailboxes.get(loop)
        if box is None:
            for closed in [old for old in mailboxes if old.is_closed()]:
                del mailboxes[closed]
            box = mailboxes[loop] = Mailbox(loop)
        return box

    def num_waiting(tenant: str | None = None) -> int:
        """Requests that will wait for a seat: queued (or being admitted) beyond the free seats."""
        extra = admitting[tenant] if tenant is not None else sum(admitting.values())
        return max(0, deps.engine.num_queued(tenant) + extra - deps.engine.free_seats())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        msg = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 404:
            msg += "; routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics"
        return error_response(ApiError(e.status_code, msg))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not deps.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "minikv", "max_model_len": deps.llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(deps.metrics.render(deps.engine.snapshot()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def handle(request: Request, chat: bool):
        try:
            return await admit(request, chat)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001  a bug of ours: still an OpenAI-shaped answer, and the server goes on
            log.exception("request failed")
            raise ApiError(500, f"the server failed on this request ({type(e).__name__}); it serves on",
                           type="server_error") from None

    async def admit(request: Request, chat: bool):
        started = time.perf_counter()
        raw = await read_body(request, max_body_bytes)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int of 4,300+ digits, deep nesting
            deps.metrics.rejected_request("bad_request")
            why = "it nests too deeply" if isinstance(e, RecursionError) else f"{e}"[:200]
            raise ApiError(400, f"the request body is not valid JSON: {why}") from None
        try:
            parsed = parse_request(body, chat, [served_name], raw)
            check_max_tokens(parsed, chat)
        except ApiError as e:
            deps.metrics.rejected_request("bad_request" if e.status < 404 else "not_found")
            raise
        tenant = deps.tenants.of(request.headers.get("authorization", ""), parsed.user)
        if max_waiting_per_tenant is not None and num_waiting(tenant) >= max_waiting_per_tenant:
            deps.metrics.rejected_request("tenant_limit")
            raise ApiError(429, f"tenant {tenant} already has {max_waiting_per_tenant} requests waiting for a seat "
                                "(--max-waiting-per-tenant); retry after a second", type="rate_limit_exceeded",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if num_waiting() >= max_waiting:
            deps.metrics.rejected_request("overloaded")
            raise ApiError(503, f"the server is overloaded: {max_waiting} requests are already waiting for a seat "
                                "(--max-waiting); retry after a second", type="server_overloaded",
                           headers={"Retry-After": "1"})
        if not deps.engine.alive:
            raise ApiError(503, "the engine has stopped; the server is shutting down", type="server_error")
        rid, loop, events, box = new_id(chat), asyncio.get_running_loop(), asyncio.Queue(), mailbox()
        admitting[tenant] += 1
        try:
            if chat or isinstance(parsed.prompt, str):  # a tokenizer's work: never on the event loop
                ids = await loop.run_in_executor(deps.tokenizer_pool, token_ids, parsed, chat)
            else:  # token ids: checked at C speed (prompts.check_token_range), here: no thread hop
                ids = token_ids(parsed, chat)
            prompt = {"prompt_token_ids": ids}
            salt = deps.tenants.cache_salt(tenant, parsed.cache_salt)
            if salt is not None:
                prompt["cache_salt"] = salt
            if before_submit is not None:
                await before_submit(request.headers, ids, salt)
            deps.engine.submit(prompt, parsed.params, tenant, rid, lambda ev: box.put(events, ev))
        except ApiError:
            deps.metrics.rejected_request("bad_request")
            raise
        finally:
            admitting[tenant] -= 1
            if not admitting[tenant]:
                del admitting[tenant]
        try:
            first: Event = await events.get()
        except asyncio.CancelledError:  # the client went away before the engine took it
            deps.engine.abort(rid)
            raise
        if first.kind == "rejected":
            deps.metrics.rejected_request("bad_request")
            raise ApiError(400, str(first.error), param="messages" if chat else "prompt")
        if first.kind == "failed":
            raise ApiError(503 if not deps.engine.alive else 500,
                           f"the engine could not run this request ({describe(first.error)})",
                           type="server_error")
        if parsed.stream:
            return StreamingResponse(stream(rid, chat, parsed, events, first.prompt_tokens, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(request, rid, chat, parsed, events)

    def check_max_tokens(parsed: Parsed, chat: bool) -> None:
        if parsed.params.max_tokens > deps.llm.max_model_len:
            raise ApiError(400, f"'max_tokens' is {parsed.params.max_tokens:,} but this model's context is "
                                f"{deps.llm.max_model_len:,} tokens (prompt included); lower max_tokens",
                           param="max_tokens")
        if chat and (deps.llm.tokenizer is None or not getattr(deps.llm.tokenizer, "chat_template", None)):
            raise ApiError(400, f"model {served_name!r} has no chat template; use /v1/completions "
                                "(with token ids if it has no tokenizer)", param="messages")
        if not parsed.max_tokens_given and chat:
            parsed.params.max_tokens = deps.llm.max_model_len  # until EOS or the context is full

    def token_ids(parsed: Parsed, chat: bool) -> list[int]:
        """(On a tokenizer thread.) The prompt's token ids, checked against max_model_len and the
        vocabulary; a text far too long is refused before it is tokenized."""
        param = "messages" if chat else "prompt"
        prompt = parsed.prompt
        if chat:
            prompt = deps.llm.tokenizer.apply_chat_template(parsed.messages, tokenize=False, add_generation_prompt=True)
        if isinstance(prompt, str) and text_limit and len(prompt) > text_limit // 4:
            size = len(prompt.encode("utf-8"))
            if size > text_limit:
                raise ApiError(400, f"prompt has {size:,} bytes of text, more than {deps.llm.max_model_len:,} tokens "
                                    f"(max_model_len) can hold; shorten the prompt", param=param)
        if isinstance(prompt, list) and len(prompt) > deps.llm.max_model_len:
            raise ApiError(400, f"prompt has {len(prompt):,} tokens but max_model_len is {deps.llm.max_model_len:,}; "
                                "shorten the prompt", param=param)
        try:
            ids, _, _ = deps.llm.encode(prompt)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None
        return ids

    async def collect(request: Request, rid: str, chat: bool, parsed: Parsed, events: asyncio.Queue) -> dict:
        n = parsed.params.n
        texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        loop = asyncio.get_running_loop()
        next_check = loop.time() + POLL_DISCONNECT_S
        try:
            while True:
                try:
                    ev: Event | None = await asyncio.wait_for(events.get(), POLL_DISCONNECT_S)
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() >= next_check:  # tokens may keep coming: check by the clock, not on silence
                    next_check = loop.time() + POLL_DISCONNECT_S
                    if await request.is_disconnected():
                        deps.engine.abort(rid)
                        return {}
                if ev is None:
                    continue
                if ev.kind == "tokens":
                    texts[ev.index] += ev.text
                    ids[ev.index] += ev.token_ids
                    reasons[ev.index] = ev.finish_reason or reasons[ev.index]
                elif ev.kind == "failed":
                    raise ApiError(500, f"the engine failed on this request ({describe(ev.error)})",
                                   type="server_error")
                elif ev.kind == "end":
                    choices = [choice(chat, i, texts[i], reasons[i], ids[i] if parsed.return_token_ids else None,
                                      delta=False) for i in range(n)]
                    return envelope(chat, rid, served_name, now(), choices, False,
                                    usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))
        except asyncio.CancelledError:
            deps.engine.abort(rid)
            raise

    async def stream(rid: str, chat: bool, parsed: Parsed, events: asyncio.Queue,
                     prompt_tokens: int, started: float) -> AsyncIterator[str]:
        """The chunks of one answer; it always ends with [DONE], an engine failure included."""
        created_at, done, generated, first_sent = now(), False, 0, None

        def sse(choices: list[dict], usage_: dict | None = None) -> str:
            chunk = envelope(chat, rid, served_name, created_at, choices, True, usage_)
            if parsed.include_usage or parsed.continuous_usage:
                chunk.setdefault("usage", None)  # as OpenAI: null on every chunk but the usage one
            return f"data: {json.dumps(chunk)}\n\n"

        def so_far() -> dict | None:
            return usage(prompt_tokens, generated, 0) if parsed.continuous_usage else None

        held: list[Event] = []  # taken from the queue while coalescing, not yet sent

        async def coalesced(ev: Event, want: int) -> Event:
            """ev and the tokens events of the same sample already waiting behind it, as one: a server
            that falls behind sends fewer, fuller chunks instead of falling further behind. Until the chunk
            holds `want` tokens it waits for more (stream_interval), unless the sample ends or another
            sample's event, or the end, comes first."""
            ids_, text = list(ev.token_ids), [ev.text]
            reason = ev.finish_reason
            while reason is None and not held:
                if events.empty():
                    if len(ids_) >= want:
                        break
                    nxt = await events.get()
                else:
                    nxt = events.get_nowait()
                if nxt.kind != "tokens" or nxt.index != ev.index:
                    held.append(nxt)
                    break
                ids_ += nxt.token_ids
                text.append(nxt.text)
                reason = nxt.finish_reason
            return Event("tokens", ev.index, ids_, "".join(text), reason)

        try:
            if chat:  # the first chunk names the role, as OpenAI's do
                yield sse([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(parsed.params.n)], so_far())
            while True:
                ev: Event = held.pop(0) if held else await events.get()
                if ev.kind == "tokens":
                    ev = await coalesced(ev, stream_interval if generated else 1)  # the first token: at once
                    generated += len(ev.token_ids)
                    chunk = sse([choice(chat, ev.index, ev.text, ev.finish_reason,
                                        ev.token_ids if parsed.return_token_ids else None, delta=True)], so_far())
                    if first_sent is None:  # (stamped as it goes to the socket: the write follows the yield)
                        first_sent = time.perf_counter()
                    yield chunk
                elif ev.kind == "failed":
                    done = True  # the engine has forgotten it already
                    err = ApiError(500, f"the engine failed on this request ({describe(ev.error)})",
                                   type="server_error")
                    yield f"data: {err.json().decode()}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                elif ev.kind == "end":
                    done = True
                    if trace_path and ev.usage is not None and ev.usage.token_times:
                        with open(trace_path, "a") as f:  # (a line a request, only while tracing)
                            f.write(json.dumps({"id": rid, "handler": started, "arrival": ev.usage.arrival_time,
                                                "first_token": ev.usage.token_times[0],
                                                "first_sent": first_sent}) + "\n")
                    if parsed.include_usage:  # the last chunk: no choices, the whole usage
                        yield sse([], usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away (or the server stops): free its blocks now
                deps.engine.abort(rid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def generate(scope, receive, send) -> None:
        """The two routes above as plain ASGI (GenerationRoutes): the same handler, its answer sent here."""
        try:
            answer = await handle(Request(scope, receive), chat=scope["path"] == CHAT_ROUTE)
        except ApiError as e:
            answer = error_response(e)
        if isinstance(answer, StreamingResponse):
            await stream_to(answer, receive, send)
        else:
            await (answer if isinstance(answer, Response) else JSONResponse(answer))(scope, receive, send)

    app.add_middleware(GenerationRoutes, generate=generate)
    return app


CHAT_ROUTE = "/v1/chat/completions"
GENERATION_ROUTES = frozenset({"/v1/completions", CHAT_ROUTE})


class GenerationRoutes:
    """Pure ASGI in front of FastAPI's routing: a POST to a generation route goes straight to its handler,
    everything else (and other methods on those paths: 405) to the FastAPI app. A burst of 256 streaming
    requests is taken in by this one event loop, one request after another, while it writes the streams
    already running: each request's share of the framework (routing, the dependency solver, the stream's
    task group) came before the next request's handler started (benchmarks/NOTES_step_profile.md)."""

    def __init__(self, app, generate):
        self.app, self.generate = app, generate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES:
            await self.generate(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def stream_to(response: StreamingResponse, receive, send) -> None:
    """Send a stream's chunks, as Starlette's StreamingResponse does, with one watcher task instead of a task
    group: a client that goes away cancels the stream wherever it waits (the handler's `finally` frees the
    request's blocks); a stream that ends first stops the watcher."""
    task, streaming, gone = asyncio.current_task(), True, False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        if streaming:
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    chunks = response.body_iterator
    try:
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk.encode() if isinstance(chunk, str) else chunk,
                        "more_body": True})
        streaming = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not gone:  # the server stops: not ours to swallow
            raise
        if hasattr(task, "uncancel"):  # (Python 3.11+: the task is no longer being cancelled)
            task.uncancel()  # the client went away: the stream ends here, quietly
    finally:
        streaming = False
        watcher.cancel()
        await chunks.aclose()  # a stream cut short runs its `finally` now (abort: its blocks are freed)


def engine_loop_for(engine, metrics) -> EngineLoop:
    """The loop over an LLM in this process, or over an EngineCore in its own (a CoreProcess)."""
    from minikv.serve.core_process import CoreProcess

    if isinstance(engine, CoreProcess):
        return ProcessEngineLoop(engine, metrics)
    return EngineLoop(engine, metrics)


class Server(AppThread):
    """The server on a thread of this process, on a free loopback port by default (tests, notebooks,
    benchmarks). `minikv serve` runs the same app in the foreground. Should the engine loop end
    (a bug), the HTTP server stops too: clients are refused, not left hanging."""

    label = "HTTP server"  # what the start error calls it

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 0, served_name: str | None = None,
                 isolate_tenants: bool = False, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_waiting_per_tenant: int | None = None, log_level: str = "warning",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tenant_key: bytes | str | None = None,
                 before_submit=None, stream_interval: int = 1):
        self.metrics = ServerMetrics()
        self.engine = engine_loop_for(llm, self.metrics)
        self.served_name = served_name or str(llm.loaded.source)
        self.tenants = Tenants(tenant_key, isolate=isolate_tenants)
        self.app = build_app(self.engine, self.served_name, isolate_tenants, max_waiting, max_waiting_per_tenant,
                             max_body_bytes, self.tenants, before_submit, stream_interval)
        super().__init__(self.app, host, port, log_level, "minikv-http")
        self.engine.on_death.append(lambda error: setattr(self._uvicorn, "should_exit", True))

    def tenant_id(self, api_key: str) -> str:
        """The tenant id (engine, /metrics) of requests sent with this API key."""
        return self.tenants.id_of(api_key)

    def start(self, timeout: float = 30.0) -> "Server":
        self.engine.start()
        return super().start(timeout)

    def stop(self) -> None:
        super().stop()
        self.engine.stop()
        self.app.state.deps.release()  # no handler runs any more: a stopped server keeps no engine alive


def run(llm: LLM, host: str, port: int, served_name: str, isolate_tenants: bool = False,
        max_waiting: int = DEFAULT_MAX_WAITING, max_waiting_per_tenant: int | None = None,
        log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, before_submit=None,
        stream_interval: int = 1) -> None:
    """`minikv serve`: the server in the foreground until Ctrl-C / SIGTERM. If the engine loop ends
    (a bug), the server stops and the process exits with status 1, for a supervisor to restart it."""
    if max_body_bytes < 1:
        print(f"error: --max-body-bytes must be at least 1, got {max_body_bytes}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    metrics = ServerMetrics()
    engine = engine_loop_for(llm, metrics)
    app = build_app(engine, served_name, isolate_tenants, max_waiting, max_waiting_per_tenant, max_body_bytes,
                    before_submit=before_submit, stream_interval=stream_interval)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=2))
    engine.on_death.append(lambda error: setattr(server, "should_exit", True))
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()
    if engine.error is not None:
        print(f"minikv: the engine loop ended ({type(engine.error).__name__}: {engine.error}); exiting with "
              "status 1", file=sys.stderr, flush=True)
        raise SystemExit(1)
