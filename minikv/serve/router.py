"""Rung 13, many engines: one OpenAI-compatible front over several `minikv serve` replicas.

    client --POST /v1/chat/completions--> router --(policy picks one)--> replica 0  (its own prefix cache)
                                                                    \\-> replica 1  (its own prefix cache)

Where a request lands decides whether its prefix is cached: each replica caches only what it has
computed. Round robin sends a user's next turn to a replica that has never seen the first one; the
cache-aware policy remembers, per replica, the prefixes it sent there and sends a request where the
longest part of it is already cached, unless that replica is already busier than the least loaded
one by more than a threshold (then balance wins: a hot replica with every cache hit still makes its
users wait). That is the rule of SGLang's router; llm-d's prefix-cache scorer and Dynamo's KV router
weigh the same two things.

What the router remembers of a prompt is a chain of block hashes, as the prefix cache keys its blocks:

    prompt units  [ u0 .. u15 | u16 .. u31 | u32 .. u47 | u48 ..u50 ]   units: token ids, or characters of text
    hashes          h0 = H(salt, block 0)  h1 = H(h0, block 1)  h2 = H(h1, block 2)   (the tail is never a key)

so a replica "holds" a prompt's first k blocks when its table has h0 .. h(k-1). The salt is the
request's cache_salt (and, when the replicas isolate tenants, its API key): two tenants never look
like they share a prefix. After each answer the router adds the prompt with its answer (the next
turn of a chat starts with both), and reads the answer's usage: a replica that reports fewer cached
tokens than the router predicted has evicted, so the router's table of it shrinks to match.

The choice is a pure function behind one seam, `policy`: it sees each replica's `ReplicaState`
(up, load, blocks of this prompt it holds, blocks it holds), the number of full blocks in the request
and a turn counter, and returns an index.

    Router(["http://a:8001", "http://b:8002"], policy="cache_aware").start()   # a thread, a free port
    minikv route --backend http://a:8001 --backend http://b:8002 --policy cache_aware --port 8000

A replica that refuses connections, cuts an answer off, or stops answering (its /health silent while
a request waits) is taken out and the request goes to another; a stream already begun ends with an
error chunk and [DONE]. When no replica can take a request the client gets 503 naming what failed.
A replica taken out is probed and comes back when its /health answers.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from minikv.serve.app_thread import AppThread
from minikv.serve.protocol import ApiError

log = logging.getLogger("minikv.route")
POLICIES = ("cache_aware", "round_robin", "least_loaded")
DEFAULT_BLOCK_TOKENS = 16  # units of a token-id prompt per hashed block (the engine's block size)
CHARS_PER_TOKEN = 4  # a text block is this many characters per token: about the same span of prompt
DEFAULT_BALANCE_THRESHOLD = 4  # requests in flight beyond the least loaded replica before balance beats a match
DEFAULT_MIN_MATCH = 0.5  # the part of a request that must be cached on a replica for the match to count
DEFAULT_TABLE_BLOCKS = 1 << 20  # blocks remembered per replica until its answers say it holds fewer
MIN_TABLE_BLOCKS = 64
PREFILL_HEADER = "x-minikv-prefill"  # sent to a decode server: the prefill server whose KV blocks it takes


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) else str(int(x))


# ---- the seam: which replica takes a request ----------------------------------------------------

@dataclass(frozen=True)
class ReplicaState:
    """What a policy sees of one replica when a request arrives."""

    up: bool  # answering; a policy never picks a replica that is down
    load: int  # requests the router has sent there that have not ended
    matched: int  # blocks of this request's prefix the router believes the replica holds
    cached: int  # blocks the router believes the replica holds in all


Policy = Callable[[Sequence[ReplicaState], int, int], int]  # (replicas, request's blocks, turn) -> index


def _up(replicas: Sequence[ReplicaState]) -> list[int]:
    up = [i for i, r in enumerate(replicas) if r.up]
    if not up:
        raise NoReplica("every replica is down")
    return up


def round_robin(replicas: Sequence[ReplicaState], blocks: int, turn: int) -> int:
    """The next replica that is up, in turn: even load, and a user's turns scattered over every cache."""
    up = _up(replicas)
    return up[turn % len(up)]


def least_loaded(replicas: Sequence[ReplicaState], blocks: int, turn: int) -> int:
    """The replica with the fewest requests in flight (ties taken in turn)."""
    up = _up(replicas)
    low = min(replicas[i].load for i in up)
    ties = [i for i in up if replicas[i].load == low]
    return ties[turn % len(ties)]


def cache_aware(replicas: Sequence[ReplicaState], blocks: int, turn: int,
                balance_threshold: int = DEFAULT_BALANCE_THRESHOLD, min_match: float = DEFAULT_MIN_MATCH) -> int:
    """Match or balance. The replica holding the longest prefix of the request (ties: the less loaded,
    then the lower index), if that prefix is more than `min_match` of the request's `blocks` and the
    replica has no more than `balance_threshold` requests in flight beyond the least loaded one.
    Otherwise the least loaded replica (ties: the one holding fewest blocks, so new conversations
    spread over the caches, then in turn): a system prompt every user shares is no reason to send
    every user to one replica."""
    up = _up(replicas)
    best = max(up, key=lambda i: (replicas[i].matched, -replicas[i].load, -i))
    low = min(replicas[i].load for i in up)
    matched = replicas[best].matched
    if matched > min_match * blocks and replicas[best].load - low <= balance_threshold:
        return best
    ties = [i for i in up if replicas[i].load == low]
    fewest = min(replicas[i].cached for i in ties)
    ties = [i for i in ties if replicas[i].cached == fewest]
    return ties[turn % len(ties)]


def policy_named(name: str, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD) -> Policy:
    if name == "cache_aware":
        return lambda replicas, blocks, turn: cache_aware(replicas, blocks, turn, balance_threshold)
    if name == "round_robin":
        return round_robin
    if name == "least_loaded":
        return least_loaded
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")


class NoReplica(Exception):
    """No replica can take the request (all down, or all tried)."""


# ---- what the router remembers of each replica's cache -------------------------------------------

def block_hashes(units: Sequence[int] | str, block: int, salt: str = "") -> list[bytes]:
    """The chain of hashes of the full blocks of a prompt: each hash covers its block and every block
    before it (a text is cut into blocks of characters, a token-id prompt into blocks of ids)."""
    out: list[bytes] = []
    prev = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    for start in range(0, len(units) - block + 1, block):
        piece = units[start:start + block]
        data = (piece.encode("utf-8", "surrogatepass") if isinstance(piece, str)
                else struct.pack(f"<{len(piece)}q", *piece))
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        out.append(prev)
    return out


class PrefixTable:
    """The block hashes the router believes one replica holds, least recently used first. A chain's
    hashes go in together, so "holds h(k)" implies "holds h0 .. h(k-1)" up to evictions in between,
    which `match` stops at."""

    def __init__(self, capacity: int = DEFAULT_TABLE_BLOCKS):
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def forgot(self, hashes: Sequence[bytes], kept: int) -> int:
        """The replica kept only the first `kept` blocks of a chain the table holds further: it evicted,
        so its cache is smaller than the table. Drop those blocks and shrink the table to the size the
        replica must have had; return how many blocks were dropped."""
        held = self.match(hashes)
        if kept >= held:
            return 0
        for h in hashes[kept:held]:
            self.blocks.pop(h, None)
        self.capacity = max(MIN_TABLE_BLOCKS, min(self.capacity, len(self.blocks)))
        return held - kept


# ---- the router's state: replicas, tables, counters (no HTTP here) ------------------------------

class Replica:
    def __init__(self, url: str, table_blocks: int):
        self.url = url.rstrip("/")
        self.up = True
        self.down_reason = ""
        self.load = 0
        self.table = PrefixTable(table_blocks)
        self.requests = self.prompt_tokens = self.cached_tokens = self.matched_blocks = 0
        self.forgotten_blocks = 0
        self.failures = 0
        self.prefill = ""  # its prefill server, when prefill and decode run on separate engines


@dataclass
class Pick:
    """One routing decision, and what the answer is learned against."""

    replica: Replica
    hashes: list[bytes]
    matched: int
    units: int  # prompt units (token ids or characters)
    balanced: bool  # the policy did not take the longest match


class RouterState:
    """The replicas and what is known of them; `pick` is the routing decision, `learn` the answer's lesson.
    Thread-safe enough for one asyncio loop (no awaits inside)."""

    def __init__(self, backends: Sequence[str], policy: str | Policy = "cache_aware",
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
                 table_blocks: int = DEFAULT_TABLE_BLOCKS, isolate_tenants: bool = False, prefill: Sequence[str] = ()):
        if prefill and len(prefill) != len(backends):
            raise ValueError(f"{len(prefill)} prefill servers for {len(backends)} decode servers; give one --prefill "
                             "URL per --decode URL (each decode server is paired with the prefill server it receives "
                             "KV blocks from, in order)")
        if not backends:
            raise ValueError("the router needs at least one backend; give --backend URL (once per replica)")
        if len(set(b.rstrip("/") for b in backends)) != len(backends):
            raise ValueError(f"a backend is given twice in {list(backends)}; give each replica's URL once")
        for b in backends:
            if not b.startswith(("http://", "https://")):
                raise ValueError(f"backend {b!r} is not an http(s) URL; give it as http://HOST:PORT")
        if block_tokens < 1 or balance_threshold < 0:
            raise ValueError(f"block_tokens must be >= 1 and balance_threshold >= 0, got {block_tokens} and "
                             f"{balance_threshold}")
        self.policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
        self.policy = policy_named(policy, balance_threshold) if isinstance(policy, str) else policy
        self.replicas = [Replica(b, table_blocks) for b in backends]
        for r, p in zip(self.replicas, prefill):
            r.prefill = p.rstrip("/")
        self.block_tokens, self.isolate_tenants = block_tokens, isolate_tenants
        self.turn = 0
        self.retries = self.balanced = 0
        self.failed: dict[str, int] = {}

    def prefix_of(self, body: dict, chat: bool, authorization: str) -> tuple[list[int] | str, int, str]:
        """(units, block size in units, salt) of a request body: what its cacheable prefix looks like."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else ""
        if self.isolate_tenants:
            salt = f"{len(authorization)}:{authorization}{salt}"
        text_block = self.block_tokens * CHARS_PER_TOKEN
        if chat:
            return chat_text(body.get("messages")), text_block, salt
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, text_block, salt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [t % (1 << 63) for t in prompt], self.block_tokens, salt
        return "", text_block, salt

    def pick(self, units: list[int] | str, block: int, salt: str, exclude: Sequence[Replica] = ()) -> Pick:
        hashes = block_hashes(units, block, salt)
        states = [ReplicaState(r.up and r not in exclude, r.load, r.table.match(hashes), len(r.table))
                  for r in self.replicas]
        if not any(s.up for s in states):
            down = [f"{r.url} ({r.down_reason or 'tried'})" for r in self.replicas]
            raise NoReplica("no replica could take this request: " + ", ".join(down))
        i = self.policy(states, len(hashes), self.turn)
        if not (isinstance(i, int) and 0 <= i < len(states) and states[i].up):
            raise RuntimeError(f"routing policy {self.policy_name!r} chose {i!r}, not the index of a replica "
                               "that is up")
        self.turn += 1
        best = max(s.matched for s in states if s.up)
        r = self.replicas[i]
        r.load += 1
        r.requests += 1
        r.matched_blocks += states[i].matched
        balanced = states[i].matched < best
        self.balanced += balanced
        return Pick(r, hashes, states[i].matched, len(units), balanced)

    def release(self, pick: Pick) -> None:
        pick.replica.load -= 1

    def learn(self, pick: Pick, answered: list[int] | str, block: int, salt: str, usage: dict | None) -> None:
        """An answer came back: the replica holds the prompt with its answer now; its usage says how much
        of the prompt it found cached (fewer than predicted: it had evicted)."""
        r = pick.replica
        if isinstance(usage, dict):
            prompt_tokens = usage.get("prompt_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            cached = (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
            if isinstance(prompt_tokens, int) and isinstance(cached, int) and prompt_tokens > 0:
                r.prompt_tokens += prompt_tokens
                r.cached_tokens += cached
                kept = (cached * pick.units) // (prompt_tokens * block)  # the blocks it held, in the router's units
                r.forgotten_blocks += r.table.forgot(pick.hashes, kept)
        r.table.insert(block_hashes(answered, block, salt) if answered else pick.hashes)

    def mark_down(self, r: Replica, why: str) -> None:
        if r.up:
            log.warning("replica %s taken out: %s", r.url, why)
        r.up, r.down_reason = False, why
        r.failures += 1

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1

    def render(self) -> str:
        """GET /metrics of the router, Prometheus text."""
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, values: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in values)

        def each(get: Callable[[Replica], float]) -> list[tuple[str, float]]:
            return [(f'{{replica="{_label(r.url)}"}}', get(r)) for r in self.replicas]

        metric("minikv:router_replica_up", "gauge", "1 while the replica answers, 0 once taken out.",
               each(lambda r: int(r.up)))
        metric("minikv:router_requests_in_flight", "gauge", "Requests sent to the replica and not ended.",
               each(lambda r: r.load))
        metric("minikv:router_requests_total", "counter", "Requests routed to the replica.", each(lambda r: r.requests))
        metric("minikv:router_matched_blocks_total", "counter",
               "Prefix blocks the router believed cached on the replica when it chose it.",
               each(lambda r: r.matched_blocks))
        metric("minikv:router_prompt_tokens_total", "counter", "Prompt tokens the replica's answers reported.",
               each(lambda r: r.prompt_tokens))
        metric("minikv:router_cached_tokens_total", "counter", "Of which its prefix cache held (usage.cached_tokens).",
               each(lambda r: r.cached_tokens))
        metric("minikv:router_hit_rate", "gauge", "cached_tokens / prompt_tokens of the replica's answers.",
               each(lambda r: r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0))
        metric("minikv:router_table_blocks", "gauge", "Blocks the router believes the replica holds.",
               each(lambda r: len(r.table)))
        metric("minikv:router_forgotten_blocks_total", "counter",
               "Blocks the replica's answers showed it had evicted.", each(lambda r: r.forgotten_blocks))
        metric("minikv:router_replica_failures_total", "counter", "Times the replica was taken out.",
               each(lambda r: r.failures))
        metric("minikv:router_balanced_total", "counter",
               "Requests sent elsewhere than their longest cached prefix, to balance load.", [("", self.balanced)])
        metric("minikv:router_retries_total", "counter", "Requests sent again to another replica.",
               [("", self.retries)])
        metric("minikv:router_failed_total", "counter", "Requests the router answered with an error, by reason.",
               [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(self.failed.items())])
        return "\n".join(out) + "\n"


def chat_text(messages) -> str:
    """A chat's messages as one text in which a conversation's next turn extends its last one."""
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return ""
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(c.get("text", "") for c in content if isinstance(c, dict))
        parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)


# ---- the HTTP front --------------------------------------------------------------------------------

class ReplicaFailed(Exception):
    """The replica cut the answer off or stopped answering: take it out, try another."""


def _error(status: int, message: str, type: str = "server_error") -> Response:
    e = ApiError(status, message, type=type)
    return Response(e.json(), status_code=status, headers=e.headers, media_type="application/json")


def build_router_app(state: RouterState, probe_interval: float = 1.0, probe_timeout: float = 2.0,
                     max_body_bytes: int = 4 * 2**20) -> FastAPI:
    """The router's routes. While a request waits on a replica, the replica's /health is probed every
    `probe_interval` s; an answer missing for `probe_timeout` s takes it out."""
    from contextlib import asynccontextmanager

    from minikv.serve.app import read_body

    shared: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        shared["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=probe_timeout), trust_env=False,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        revive = asyncio.create_task(bring_back())
        try:
            yield
        finally:
            revive.cancel()
            await shared.pop("client").aclose()

    app = FastAPI(title="minikv router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.router = state

    checked: dict[str, tuple[float, bool]] = {}  # replica URL -> (when, answer) of its last /health probe

    async def healthy(r: Replica) -> bool:
        """Does the replica answer /health? One probe per replica per `probe_interval`, however many
        requests wait on it."""
        now_ = asyncio.get_running_loop().time()
        last = checked.get(r.url)
        if last is not None and now_ - last[0] < probe_interval:
            return last[1]
        try:
            resp = await shared["client"].get(r.url + "/health", timeout=probe_timeout)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        checked[r.url] = (asyncio.get_running_loop().time(), ok)
        return ok

    async def bring_back() -> None:
        """Probe the replicas taken out; one whose /health answers 200 is back in."""
        while True:
            await asyncio.sleep(probe_interval)
            for r in state.replicas:
                if not r.up and await healthy(r):
                    log.warning("replica %s is back", r.url)
                    r.up, r.down_reason = True, ""

    async def watched(r: Replica, awaitable):
        """`awaitable`'s result; while it waits, the replica's /health is probed, and a replica that does
        not answer it is a failed one (ReplicaFailed). A cut connection is a failed replica too."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=probe_interval)
                if done:
                    return task.result()
                if not await healthy(r):
                    raise ReplicaFailed("it stopped answering (its /health is silent)")
        except httpx.TransportError as e:
            raise ReplicaFailed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        finally:
            if not task.done():
                task.cancel()

    @app.get("/health")
    async def health() -> JSONResponse:
        up = sum(r.up for r in state.replicas)
        return JSONResponse({"status": "ok" if up else "no replica up", "replicas_up": up},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        for r in state.replicas:
            if r.up:
                try:
                    resp = await shared["client"].get(r.url + "/v1/models", timeout=probe_timeout)
                    return Response(resp.content, status_code=resp.status_code, media_type="application/json")
                except httpx.HTTPError as e:
                    state.mark_down(r, f"GET /v1/models failed ({type(e).__name__})")
        return _error(503, "no replica is up to list the models")

    async def forward(request: Request, path: str, chat: bool) -> Response:
        try:
            raw = await read_body(request, max_body_bytes)
        except ApiError as e:
            return _error(e.status, e.message, e.type)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None  # the replica answers it with its own 400
        authorization = request.headers.get("authorization", "")
        units, block, salt = state.prefix_of(body, chat, authorization) if isinstance(body, dict) else ("", 1, "")
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = {"content-type": "application/json"}
        if authorization:
            headers["authorization"] = authorization
        tried: list[Replica] = []
        while True:
            try:
                pick = state.pick(units, block, salt, exclude=tried)
            except NoReplica as e:
                state.fail("no_replica")
                return _error(503, f"{e}; retry later", "server_overloaded" if not tried else "server_error")
            if tried:
                state.retries += 1
            r, resp = pick.replica, None
            sent_headers = {**headers, PREFILL_HEADER: r.prefill} if r.prefill else headers
            try:
                send = shared["client"].send(shared["client"].build_request("POST", r.url + path, content=raw,
                                                                            headers=sent_headers), stream=True)
                resp = await watched(r, send)
                if resp.status_code >= 500:  # its engine stopped, or it is overloaded: another may take it
                    text = (await watched(r, resp.aread())).decode("utf-8", "replace")[:300]
                    raise ReplicaFailed(f"it answered {resp.status_code}: {text}")
                if stream and resp.status_code == 200:
                    chunks = resp.aiter_raw()
                    first = await watched(r, anext_or_none(chunks))  # a failure before the first byte: retry
                    return StreamingResponse(relay(pick, resp, chunks, first, chat, units, block, salt),
                                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
                data = await watched(r, resp.aread())
            except ReplicaFailed as e:
                if resp is not None:
                    await resp.aclose()
                state.release(pick)
                if not str(e).startswith("it answered"):  # an error answer is not a dead replica
                    state.mark_down(r, str(e))
                tried.append(r)
                continue
            except BaseException:
                if resp is not None:
                    await resp.aclose()
                state.release(pick)
                raise
            state.release(pick)
            if resp.status_code == 200:
                answer = json_or_none(data)
                learn(pick, answer, chat, units, block, salt)
            return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                            headers={k: v for k, v in resp.headers.items() if k.lower() == "retry-after"})

    def learn(pick: Pick, answer: dict | None, chat: bool, units, block: int, salt: str,
              streamed: str | None = None) -> None:
        usage = answer.get("usage") if isinstance(answer, dict) else None
        text = streamed
        if text is None and isinstance(answer, dict):
            choices = answer.get("choices") or [{}]
            first = choices[0] if isinstance(choices[0], dict) else {}
            text = (first.get("message") or {}).get("content") if chat else first.get("text")
        answered: list[int] | str = ""
        if isinstance(units, str) and isinstance(text, str) and text:
            answered = units + (f"<assistant>{text}\x1e" if chat else text)
        state.learn(pick, answered, block, salt, usage)

    async def relay(pick: Pick, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes | None, chat: bool,
                    units, block: int, salt: str) -> AsyncIterator[bytes]:
        """The replica's SSE bytes as they come; the text and usage are read on the way, to learn from."""
        r, buffer, pieces, usage, finished = pick.replica, b"", [], None, False
        try:
            chunk = first
            while chunk is not None:
                yield chunk
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    event = json_or_none(payload)
                    if isinstance(event, dict):
                        usage = event.get("usage") or usage
                        for c in event.get("choices") or []:
                            if isinstance(c, dict) and c.get("index", 0) == 0:
                                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                                pieces.append(piece if isinstance(piece, str) else "")
                chunk = await watched(r, anext_or_none(chunks))
            if finished:
                learn(pick, {"usage": usage}, chat, units, block, salt, streamed="".join(pieces))
            else:
                raise ReplicaFailed("it ended the stream without [DONE]")
        except ReplicaFailed as e:
            state.mark_down(r, str(e))
            state.fail("replica_failed_mid_stream")
            err = ApiError(502, f"replica {r.url} failed in the middle of this stream ({e}); the answer is cut "
                                "short: send the request again", type="server_error")
            yield f"data: {err.json().decode()}\n\ndata: [DONE]\n\n".encode()
        finally:
            state.release(pick)
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", chat=True)

    return app


async def anext_or_none(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def json_or_none(data: bytes):
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


class Router(AppThread):
    """The router on a thread of this process, on a free loopback port by default (tests, notebooks,
    benchmarks); `minikv route` runs the same app in the foreground. `prefill`: one prefill server per
    backend (then each backend is a decode server, paired in order; minikv/serve/disagg.py)."""

    def __init__(self, backends: Sequence[str], policy: str | Policy = "cache_aware", host: str = "127.0.0.1",
                 port: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 balance_threshold: int = DEFAULT_BALANCE_THRESHOLD, isolate_tenants: bool = False,
                 probe_interval: float = 1.0, probe_timeout: float = 2.0, log_level: str = "warning",
                 prefill: Sequence[str] = ()):
        self.state = RouterState(backends, policy, block_tokens, balance_threshold, isolate_tenants=isolate_tenants,
                                 prefill=prefill)
        super().__init__(build_router_app(self.state, probe_interval, probe_timeout), host, port, log_level,
                         "minikv-router")


def run_router(backends: Sequence[str], host: str, port: int, policy: str = "cache_aware",
               block_tokens: int = DEFAULT_BLOCK_TOKENS, balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
               isolate_tenants: bool = False, log_level: str = "info", prefill: Sequence[str] = ()) -> None:
    """`minikv route`: the router in the foreground until Ctrl-C / SIGTERM."""
    state = RouterState(backends, policy, block_tokens, balance_threshold, isolate_tenants=isolate_tenants,
                        prefill=prefill)
    uvicorn.Server(uvicorn.Config(build_router_app(state), host=host, port=port, log_level=log_level,
                                  timeout_graceful_shutdown=2)).run()


# ---- `minikv serve --data-parallel-size N`: N replicas and the router, one command ----------------

def replica_argv(argv: Sequence[str]) -> list[str]:
    """The command line of a replica (`serve ...`): the front's own, less what the front keeps
    (--data-parallel-size, --host, --port)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--data-parallel-size", "--host", "--port"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(procs: Sequence, urls: Sequence[str], timeout: float, poll_s: float = 0.1) -> None:
    """Wait until the server of each process answers /health with 200. RuntimeError, naming the server,
    when its process exits first or it does not answer within `timeout` s (for all of them)."""
    import time

    deadline = time.monotonic() + timeout
    for proc, url in zip(procs, urls):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with status {proc.returncode} before it served")
            try:
                if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer /health within {timeout:.0f} s")
            time.sleep(poll_s)


def serve_data_parallel(argv: Sequence[str], size: int, host: str, port: int, policy: str = "cache_aware",
                        log_level: str = "info", start_timeout: float = 600.0) -> int:
    """Start `size` replicas (`minikv serve` processes on loopback ports; one GPU each when there are
    enough), wait until each answers /health, then run the router on host:port in the foreground.
    The replicas end with it."""
    import os
    import signal
    import subprocess
    import sys

    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
    gpus = 0
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch

        gpus = torch.cuda.device_count()
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(size):
            p = free_port()
            env = dict(os.environ)
            if gpus >= size:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            procs.append(subprocess.Popen([sys.executable, "-m", "minikv.cli", *replica_argv(argv),
                                           "--host", "127.0.0.1", "--port", str(p)], env=env))
            urls.append(f"http://127.0.0.1:{p}")
            print(f"minikv: replica {i} (pid {procs[-1].pid}) at {urls[-1]}", flush=True)
        try:
            wait_healthy(procs, urls, start_timeout)
        except RuntimeError as e:
            print(f"error: replica {e}", file=sys.stderr, flush=True)
            return 1
        print(f"minikv: routing ({policy}) at http://{host}:{port}/v1 over {size} replicas: {', '.join(urls)}",
              flush=True)
        # uvicorn re-raises the SIGTERM it caught once it has shut down: end with an exception, so that the
        # replicas are stopped below instead of left running
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        run_router(urls, host, port, policy, log_level=log_level)
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
