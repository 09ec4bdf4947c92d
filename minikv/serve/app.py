"""The HTTP server: the OpenAI API over one engine loop (FastAPI + uvicorn).

    POST /v1/completions         prompt (text or token ids)        -> text_completion (or a stream)
    POST /v1/chat/completions    messages, through the chat template -> chat.completion (or a stream)
    GET  /v1/models              the served model
    GET  /health                 200 while the engine loop runs
    GET  /metrics                Prometheus text (minikv/serve/metrics.py)

A stream is server-sent events, one `data: {chunk}` per engine step that gave the request tokens,
then `data: [DONE]`. Tenants: the `user` field names one, else the API key (`Authorization: Bearer
KEY`), else "anonymous". With isolate_tenants, each tenant's prompts are salted with its name, so
two tenants never share a cached block (nor learn, from a fast first token, what the other sent).

    server = Server(LLM("tiny-random", kv_backend="paged"), port=0).start()   # a thread, a free port
    openai.OpenAI(base_url=server.url + "/v1", api_key="alice").completions.create(...)
    server.stop()
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minikv.engine.llm import LLM
from minikv.serve.engine_loop import EngineLoop, Event
from minikv.serve.metrics import ServerMetrics
from minikv.serve.protocol import ApiError, Parsed, choice, envelope, new_id, now, parse_request, usage

log = logging.getLogger("minikv.serve")
DEFAULT_MAX_WAITING = 256  # requests queued for a seat before the server answers 503 (Retry-After)
POLL_DISCONNECT_S = 0.25  # how often a non-streaming handler checks that its client is still there


def tenant_of(request: Request, parsed: Parsed) -> str:
    if parsed.user:
        return parsed.user
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return key or "anonymous"


def build_app(engine: EngineLoop, served_name: str, isolate_tenants: bool = False,
              max_waiting: int = DEFAULT_MAX_WAITING, max_waiting_per_tenant: int | None = None) -> FastAPI:
    """max_waiting: requests waiting for a seat before anyone gets 503. max_waiting_per_tenant: before
    that tenant gets 429 (so a flood is refused to the tenant who floods, not to everyone)."""
    llm, metrics = engine.llm, engine.metrics
    app = FastAPI(title="minikv", docs_url=None, redoc_url=None, openapi_url=None)
    created = now()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 404:
            msg += "; routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics"
        return JSONResponse(ApiError(e.status_code, msg).body(), status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "minikv", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(llm), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            metrics.rejected_request("bad_request")
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        try:
            parsed = parse_request(body, chat, [served_name])
            prompt = engine_prompt(parsed, chat)
        except ApiError as e:
            metrics.rejected_request("bad_request" if e.status < 404 else "not_found")
            raise
        tenant = tenant_of(request, parsed)
        if max_waiting_per_tenant is not None and engine.num_waiting(tenant) >= max_waiting_per_tenant:
            metrics.rejected_request("tenant_limit")
            raise ApiError(429, f"tenant {tenant!r} already has {max_waiting_per_tenant} requests waiting for a seat "
                                "(--max-waiting-per-tenant); retry after a second", type="rate_limit_exceeded",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if engine.num_waiting() >= max_waiting:
            metrics.rejected_request("overloaded")
            raise ApiError(503, f"the server is overloaded: {max_waiting} requests are already waiting for a seat "
                                "(--max-waiting); retry after a second", type="server_overloaded",
                           headers={"Retry-After": "1"})
        salt = "/".join(s for s in (tenant if isolate_tenants else None, parsed.cache_salt) if s) or None
        if salt is not None:
            prompt = {**prompt, "cache_salt": salt}
        rid, loop, events = new_id(chat), asyncio.get_running_loop(), asyncio.Queue()
        engine.submit(prompt, parsed.params, tenant, rid, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        first: Event = await events.get()
        if first.kind == "rejected":
            metrics.rejected_request("bad_request")
            raise ApiError(400, str(first.error), param="messages" if chat else "prompt")
        if parsed.stream:
            return StreamingResponse(stream(rid, chat, parsed, events, first.prompt_tokens),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(request, rid, chat, parsed, events)

    def engine_prompt(parsed: Parsed, chat: bool) -> dict:
        if parsed.params.max_tokens > llm.max_model_len:
            raise ApiError(400, f"'max_tokens' is {parsed.params.max_tokens:,} but this model's context is "
                                f"{llm.max_model_len:,} tokens (prompt included); lower max_tokens", param="max_tokens")
        if not parsed.max_tokens_given and chat:
            parsed.params.max_tokens = llm.max_model_len  # until EOS or the context is full
        if not chat:
            key = "prompt" if isinstance(parsed.prompt, str) else "prompt_token_ids"
            return {key: parsed.prompt}
        tok = llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model {served_name!r} has no chat template; use /v1/completions "
                                "(with token ids if it has no tokenizer)", param="messages")
        return {"prompt": tok.apply_chat_template(parsed.messages, tokenize=False, add_generation_prompt=True)}

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
                        engine.abort(rid)
                        return {}
                if ev is None:
                    continue
                if ev.kind == "tokens":
                    texts[ev.index] += ev.text
                    ids[ev.index] += ev.token_ids
                    reasons[ev.index] = ev.finish_reason or reasons[ev.index]
                elif ev.kind == "failed":
                    raise ApiError(500, f"the engine failed on this request: {ev.error}", type="server_error")
                elif ev.kind == "end":
                    choices = [choice(chat, i, texts[i], reasons[i], ids[i] if parsed.return_token_ids else None,
                                      delta=False) for i in range(n)]
                    return envelope(chat, rid, served_name, now(), choices, False,
                                    usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))
        except asyncio.CancelledError:
            engine.abort(rid)
            raise

    async def stream(rid: str, chat: bool, parsed: Parsed, events: asyncio.Queue,
                     prompt_tokens: int) -> AsyncIterator[str]:
        created_at, done = now(), False

        def sse(choices: list[dict], usage_: dict | None = None) -> str:
            return f"data: {json.dumps(envelope(chat, rid, served_name, created_at, choices, True, usage_))}\n\n"

        try:
            if chat:  # the first chunk names the role, as OpenAI's do
                yield sse([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(parsed.params.n)])
            while True:
                ev: Event = await events.get()
                if ev.kind == "tokens":
                    yield sse([choice(chat, ev.index, ev.text, ev.finish_reason,
                                      ev.token_ids if parsed.return_token_ids else None, delta=True)])
                elif ev.kind == "failed":
                    err = ApiError(500, f"the engine failed on this request: {ev.error}", type="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                elif ev.kind == "end":
                    u = usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                    # usage in every answer: on a last chunk with no choices, as with include_usage
                    yield sse([], u)
                    yield "data: [DONE]\n\n"
                    done = True
                    return
        finally:
            if not done:  # the client went away (or the server stops): free its blocks now
                engine.abort(rid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class Server:
    """The server on a thread of this process, on a free loopback port by default (tests, notebooks,
    benchmarks). `minikv serve` runs the same app in the foreground."""

    def __init__(self, llm: LLM, host: str = "127.0.0.1", port: int = 0, served_name: str | None = None,
                 isolate_tenants: bool = False, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_waiting_per_tenant: int | None = None, log_level: str = "warning"):
        self.metrics = ServerMetrics()
        self.engine = EngineLoop(llm, self.metrics)
        self.served_name = served_name or str(llm.loaded.source)
        self.app = build_app(self.engine, self.served_name, isolate_tenants, max_waiting, max_waiting_per_tenant)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve(sockets=[self._sock])),
                                        name="minikv-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Server":
        self.engine.start()
        self._thread.start()
        waited = 0.0
        while not self._uvicorn.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the HTTP server did not start on {self.url} within {timeout} s")
            threading.Event().wait(0.02)
            waited += 0.02
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self.engine.stop()
        self._sock.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(llm: LLM, host: str, port: int, served_name: str, isolate_tenants: bool = False,
        max_waiting: int = DEFAULT_MAX_WAITING, max_waiting_per_tenant: int | None = None,
        log_level: str = "info") -> None:
    """`minikv serve`: the server in the foreground until Ctrl-C / SIGTERM."""
    metrics = ServerMetrics()
    engine = EngineLoop(llm, metrics).start()
    app = build_app(engine, served_name, isolate_tenants, max_waiting, max_waiting_per_tenant)
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=2)).run()
    finally:
        engine.stop()
