"""Rung 13, prefill and decode on separate engines: the prompt's KV blocks are sent between them.

A long prompt's prefill stalls every other user's next token on the same engine (one step runs both).
Disaggregation (DistServe, Splitwise, Mooncake; vLLM's and SGLang's prefill/decode connectors) runs
prompts on a prefill engine and the token-by-token decode on another, and sends the prompt's KV
blocks across. Here the decode engine admits the request through the prefix cache it already has.

A request's life (the router names the prefill server in the x-minikv-prefill header):

    decode server (kv_offload_store=Inbox())          prefill server
    ----------------------------------------          --------------
    expect transfer id t: (ids, salt)
    POST /kv/prefill {ids, salt, transfer_id: t} -->  queued. The batcher thread drains the queue each round
                                                      and runs every waiting prompt in ONE engine call
                                                      (max_tokens=1), as a continuous-batching engine would;
                                                      each prompt, as it finishes, is exported (its full
                                                      blocks, read from the prefix cache) and handed to the
                                                      sender thread, while the next round prefills. The
                                                      sender sends all it was handed since its last transfer
                                                      as ONE transfer (k requests):
    receiver thread, one transfer at a time   <------ head: k, identity, plane formats       (one message)
                                              <------ index: (t, n) per request, every key   (one message)
    another identity? REFUSED. t forgotten? n.
    else held_t: leading blocks in pool or inbox
                                              ------> held per request                       (the one answer)
    inbox[key] = block                        <------ blocks [held_t, n_t) of each request   (one message)
    the request waiting on t is released:
    submitted as usual, the prefix cache hits what it held, the offload seam finds the rest in the inbox
    and copies it into the pool (rung 9), and only the tail (at least the last token) runs

Why this keeps up with its load: prompts that arrive while the prefill engine is busy share its next
round, and the prompts that finish while a transfer is on the wire share the next transfer, which costs
one round trip (the answer) whatever its size. Both sides see the transfers in the order the prefill
server sends them; the transfer ids in the index say which request each block belongs to, so the decode
server needs no lock around its HTTP call: many transfers may be expected at once, and its receiver
hands each request its own.

A key is identity.store_key(engine identity, hash chain key): the chain key covers every token before
and the cache salt, the identity the weights, dtype and pool format. So a block never lands in the
wrong tenant's or the wrong model's cache: it would never be looked up there. The transport is
torch.distributed point-to-point (gloo between CPUs, NCCL between GPUs) on a process group of two
ranks of its own (the default group stays free for tensor parallelism).

What can fail, and what then: a prompt the prefill engine refuses or fails is sent with n = 0 blocks
(that request alone is computed on the decode engine; the others of its round are sent). A transfer
that fails or times out (a peer gone, a message lost) leaves the channel out of step: it is marked
broken, every transfer expected then resolves to 0 blocks, and the decode engine computes those
prompts and all later ones itself. A request whose transfer does not arrive within the decode side's
timeout is computed there; when its blocks come late they are answered n ("nothing wanted") and the
stream stays in step.

    prefill, decode = LLM(...), LLM(..., kv_offload_store=Inbox())
    a, b = KVChannel.pair()                        # two ranks in one process (tests); connect() across processes
    thread: send_prefill(prefill, a, ids)          # decode side: receive_prefill(decode, b, ids)
"""
from __future__ import annotations

import datetime
import itertools
import logging
import math
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("minikv.disagg")
KEY_BYTES = 32  # identity.store_key: sha256
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
REFUSED = -1  # the decode engine's answer when the identities differ
HEAD_INTS = 64  # the head of a transfer, int64: see _head


class Inbox:
    """The decode engine's store of received blocks (a `kv_offload_store`: put, get, in), least recently
    used dropped first past `capacity` blocks. Blocks the decode engine's pool evicts land here too,
    as in a CPU tier. It keeps the tensors it is given, views included (a received transfer's blocks are
    views of its one buffer, which lives while any of them is here): a copy per block held the engine's
    interpreter for ~2,000 copies per 16k-token prompt."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"Inbox capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, tuple] = OrderedDict()
        self.received = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, value: tuple) -> None:
        with self._lock:
            self.blocks[key] = tuple(value)
            self.blocks.move_to_end(key)
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)

    def get(self, key: bytes) -> tuple | None:
        """The block's tensors. A block held on a GPU is handed over once (taken out): from then on it
        lives in the engine's pool and prefix cache, and the GPU memory of its transfer is let go."""
        with self._lock:
            value = self.blocks.get(key)
            if value is not None:
                if value and value[0].is_cuda:
                    del self.blocks[key]
                else:
                    self.blocks.move_to_end(key)
            return value

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class Sending:
    """A send in flight and the tensor it reads (kept alive until it is sent)."""
    work: object
    tensor: torch.Tensor

    def wait(self) -> None:
        self.work.wait()


class KVChannel:
    """One end of a two-rank process group for KV blocks (rank 0 prefill, rank 1 decode): tensors sent
    and received in order, each side waiting at most `timeout_s`. One thread per end uses it."""

    def __init__(self, group, rank: int, device: torch.device):
        self.group, self.rank, self.device = group, rank, device
        self.peer = 1 - rank
        self.broken = False  # after a failure the stream of messages is out of step: no more transfers

    @classmethod
    def connect(cls, address: str, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                device: str | torch.device = "cpu") -> "KVChannel":
        """Join the pair at host:port (rank 0 listens there). NCCL when `device` is a GPU, else gloo."""
        host, _, port = address.rpartition(":")
        if rank not in (0, 1) or not port.isdigit():
            raise ValueError(f"a KV channel is two ranks at HOST:PORT; got rank {rank} and address {address!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host or "127.0.0.1", int(port), 2, rank == 0, timeout)
        return cls(cls._group(store, rank, timeout, torch.device(device)), rank, torch.device(device))

    @classmethod
    def pair(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple["KVChannel", "KVChannel"]:
        """Both ends in this process (gloo on the CPU), for tests and notebooks."""
        store, timeout, ends = dist.HashStore(), datetime.timedelta(seconds=timeout_s), [None, None]

        def join(rank: int) -> None:
            ends[rank] = cls(cls._group(dist.PrefixStore("kv", store), rank, timeout, torch.device("cpu")), rank,
                             torch.device("cpu"))
        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return ends[0], ends[1]

    @staticmethod
    def _group(store, rank: int, timeout: datetime.timedelta, device: torch.device):
        if device.type == "cuda":  # NCCL's own watchdog bounds its waits
            return dist.ProcessGroupNCCL(store, rank, 2)
        return dist.ProcessGroupGloo(store, rank, 2, timeout)

    def on_gpu_with(self, llm) -> bool:
        """Both this channel and the engine are on a GPU: blocks go between the pool and NCCL directly."""
        return self.device.type == "cuda" and llm.core.device.type == "cuda"

    def post(self, t: torch.Tensor) -> "Sending":
        """Start sending `t` without waiting for it; `.wait()` on the answer before the end of the transfer."""
        t = t.to(self.device).contiguous()
        return Sending(self.group.send([t], self.peer, 0), t)

    def send(self, t: torch.Tensor) -> None:
        self.post(t).wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, on_device: bool = False) -> torch.Tensor:
        """The next tensor, on the host (or, with `on_device`, where it arrived: the channel's device)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.group.recv([t], self.peer, 0).wait()
        if on_device:
            if t.is_cuda:  # received on NCCL's stream: ready before another thread's stream reads it
                torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.cpu()


# ---- the wire format of one transfer: the blocks of k requests, one round trip ----------------------
#   head    int64[HEAD_INTS]   [0] k requests  [1] N keys in all  [2:6] identity (32 bytes)  [6] planes P,
#                              then per plane: dtype code, ndim, the shape of one block's slice; zeros after
#   index   uint8[16k + 32N]   (tid, n) of each request as int64, then the keys of its n full blocks
#   answer  int64[k]           held_i: blocks [0, held_i) stay on the decode side; REFUSED; n_i: nothing wanted
#                              (N > 0 only: a request with n = 0, one the prefill engine failed, gets no answer)
#   planes  uint8[bytes]       for each request, each plane's blocks [held_i, n_i) flattened   (any wanted)

Prepared = tuple[int, list[bytes], tuple]  # (transfer id, keys of the full blocks, planes [layers, n, ...])


def _head(identity: str, requests: list[Prepared]) -> torch.Tensor:
    planes = next((p for _, keys, p in requests if keys), ())
    ints = [len(requests), sum(len(keys) for _, keys, _ in requests),
            *torch.frombuffer(bytearray(bytes.fromhex(identity)), dtype=torch.int64).tolist(), len(planes)]
    for p in planes:
        ints += [DTYPES.index(p.dtype), p.dim(), p.shape[0], 1, *p.shape[2:]]
    if len(ints) > HEAD_INTS:
        raise ValueError(f"a transfer head holds {HEAD_INTS} ints but this pool's planes need {len(ints)}; "
                         "raise HEAD_INTS in minikv/serve/disagg.py")
    return torch.tensor(ints + [0] * (HEAD_INTS - len(ints)), dtype=torch.int64)


def _plane_formats(head: list[int]) -> list[tuple[torch.dtype, list[int], int]]:
    """(dtype, shape of one block's slice, bytes per element) of each plane."""
    formats, at = [], 7
    for _ in range(head[6]):
        ndim = head[at + 1]
        formats.append((DTYPES[head[at]], head[at + 2:at + 2 + ndim], torch.empty((), dtype=DTYPES[head[at]])
                        .element_size()))
        at += 2 + ndim
    return formats


def _send_blocks(channel: KVChannel, identity: str, requests: list[Prepared]) -> list[int]:
    """(Prefill side.) One transfer for these requests: head, index and keys, the answer, then the planes
    the decode side lacks. Returns the blocks sent per request. A failure marks the channel broken and raises."""
    if channel.broken:
        raise RuntimeError("this KV channel failed before and is out of step; connect a new one")
    try:
        index = torch.tensor([x for tid, keys, _ in requests for x in (tid, len(keys))], dtype=torch.int64)
        joined = b"".join(key for _, keys, _ in requests for key in keys)
        parts = [index.view(torch.uint8)] + ([torch.frombuffer(bytearray(joined), dtype=torch.uint8)] if joined else [])
        works = [channel.post(_head(identity, requests)), channel.post(torch.cat(parts))]
        if not any(keys for _, keys, _ in requests):
            for w in works:
                w.wait()
            return [0] * len(requests)
        held = channel.recv((len(requests),), torch.int64).tolist()
        for w in works:
            w.wait()
        sent = [max(0, len(keys) - h) if h != REFUSED else 0 for (_, keys, _), h in zip(requests, held)]
        chunks = [p[:, h:].contiguous().view(torch.uint8).reshape(-1)
                  for (_, keys, planes), h, s in zip(requests, held, sent) if s for p in planes]
        if chunks:
            channel.send(torch.cat(chunks))
        return sent
    except Exception:
        channel.broken = True
        raise


def _receive_blocks(llm, channel: KVChannel, wanted) -> list[tuple[int, int]]:
    """(Decode side.) The next transfer, whichever requests it carries: `wanted(tid)` gives a request's
    (ids, salt), or None when nobody waits for it any more. Returns (transfer id, blocks put in the inbox)
    per request. Raises on a failure."""
    inbox = llm.engine_config.kv_offload_store
    head = channel.recv((HEAD_INTS,), torch.int64).tolist()
    k, total = head[0], head[1]
    data = channel.recv((16 * k + KEY_BYTES * total,), torch.uint8)
    index = data[:16 * k].view(torch.int64).tolist()
    raw = data[16 * k:].numpy().tobytes()
    requests, at = [], 0
    for tid, n in zip(index[0::2], index[1::2]):
        requests.append((tid, [raw[(at + j) * KEY_BYTES:(at + j + 1) * KEY_BYTES] for j in range(n)]))
        at += n
    if total == 0:
        return [(tid, 0) for tid, _ in requests]
    if torch.tensor(head[2:6], dtype=torch.int64).numpy().tobytes().hex() != llm.core.kv_identity():
        channel.send(torch.tensor([REFUSED] * k, dtype=torch.int64))
        log.warning("refused %d KV blocks from an engine of another identity (model, dtype or pool format)", total)
        return [(tid, 0) for tid, _ in requests]
    held, asked = [], set()  # asked: keys an earlier request of this transfer asks for (in the inbox by then)
    for tid, keys in requests:
        request, h = wanted(tid), len(keys)
        if request is not None and keys:
            h = llm.core.held_prefix_blocks(*request)
            while h < len(keys) and (keys[h] in inbox or keys[h] in asked):
                h += 1
            asked.update(keys[h:])
        held.append(h)
    channel.send(torch.tensor(held, dtype=torch.int64))
    formats = _plane_formats(head)
    want = [len(keys) - h for (_, keys), h in zip(requests, held)]
    sizes = [w * math.prod(shape) * itemsize for w in want for _, shape, itemsize in formats]
    # blocks for an engine on the channel's GPU stay there: the engine gathers them into its pool on the device
    data = channel.recv((sum(sizes),), torch.uint8, channel.on_gpu_with(llm)) if sum(sizes) else None
    out, at = [], 0
    for (tid, keys), h, w in zip(requests, held, want):
        if w <= 0:
            out.append((tid, 0))
            continue
        planes = []
        for dtype, shape, itemsize in formats:
            size = w * math.prod(shape) * itemsize
            chunk = data[at:at + size]
            if at % itemsize:
                chunk = chunk.clone()  # a view as `dtype` needs an aligned start
            planes.append(chunk.view(dtype).reshape(shape[0], w, *shape[2:]))
            at += size
        for j, key in enumerate(keys[h:]):
            inbox.put(key, tuple(p[:, j] for p in planes))
        inbox.received += w
        out.append((tid, w))
    return out


def _need_inbox(llm) -> None:
    if not isinstance(llm.engine_config.kv_offload_store, Inbox):
        raise ValueError("the decode engine takes blocks into an Inbox: build it with kv_offload_store=Inbox()")


def send_prefill(llm, channel: KVChannel, ids: list[int], salt: str | None = None) -> int:
    """(Prefill side.) Run the prompt, then send its blocks the decode engine does not hold. Returns the
    number of blocks sent; 0 when the decode engine refused (another model) or held them all."""
    from minikv.engine.sampling_params import SamplingParams

    if channel.broken:
        raise RuntimeError("this KV channel failed before and is out of step; connect a new one")
    llm.generate([{"prompt_token_ids": ids, "cache_salt": salt} if salt is not None else ids],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    keys, planes = llm.core.export_prefix(ids, salt)
    return _send_blocks(channel, llm.core.kv_identity(), [(0, keys, planes)])[0]


def receive_prefill(llm, channel: KVChannel, ids: list[int], salt: str | None = None) -> int:
    """(Decode side, an LLM built with kv_offload_store=Inbox().) Take the blocks of the next transfer into
    the inbox; the request submitted next finds them. Returns the number of blocks received; 0 on a
    refusal or a failed or timed-out transfer (logged): the decode engine then computes the prompt."""
    _need_inbox(llm)
    if channel.broken:
        return 0
    try:
        return sum(got for _, got in _receive_blocks(llm, channel, lambda tid: (ids, salt)))
    except Exception as e:  # noqa: BLE001  a timeout, a peer gone: the prompt is computed here instead
        channel.broken = True
        log.warning("KV transfer failed (%s: %s); the decode engine computes the prompt", type(e).__name__, e)
        return 0


# ---- serving: `minikv serve --role prefill|decode`, `minikv route --prefill URL --decode URL` -------

PREFILL_ROUTE = "/kv/prefill"


@dataclass
class _Prefill:
    ids: list[int]
    salt: str | None
    tid: int
    done: Future = field(default_factory=Future)  # blocks sent, or the exception
    handed: bool = False  # exported (or failed) and queued to the sender
    error: Exception | None = None


class PrefillBatcher:
    """The prefill server's two threads. The batcher drains the queue of waiting prompts each round and
    runs them in one engine call; each prompt, as it finishes, is exported and handed to the sender,
    which sends what it holds as one transfer while the batcher runs the next round:

        POST ──> waiting ──> [batcher: one engine call per round] ──> to_send ──> [sender: one transfer
                                                                                   per drain] ──> done
    """

    def __init__(self, llm, channel: KVChannel):
        self.llm, self.channel, self.identity = llm, channel, llm.core.kv_identity()
        self.on_device = channel.on_gpu_with(llm)  # NCCL sends from the GPU
        self.waiting: deque[_Prefill] = deque()
        self.to_send: deque[tuple[_Prefill, list[bytes], tuple]] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.rounds = self.prefilled = self.transfers = self.sent_blocks = self.failed = 0
        self.threads = [threading.Thread(target=self._prefill_loop, name="minikv-prefill", daemon=True),
                        threading.Thread(target=self._send_loop, name="minikv-kv-send", daemon=True)]
        for t in self.threads:
            t.start()

    def submit(self, ids: list[int], salt: str | None, tid: int) -> Future:
        item = _Prefill(ids, salt, tid)
        with self.cond:
            self.waiting.append(item)
            self.cond.notify_all()
        return item.done

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _take(self, queue: deque) -> list:
        with self.cond:
            while not queue and not self.closed:
                self.cond.wait()
            items = list(queue)
            queue.clear()
            return items

    def _prefill_loop(self) -> None:
        while batch := self._take(self.waiting):
            self.rounds += 1
            try:
                self._run(batch)
            except ValueError:  # a prompt the engine refuses (too long, ...): run each alone, so it fails alone
                for item in (it for it in batch if not it.handed):
                    try:
                        self._run([item])
                    except Exception as e:  # noqa: BLE001  sent as n = 0: the decode engine computes it
                        self._hand_over(item, [], (), e)
            except Exception as e:  # noqa: BLE001  the engine failed this round: every prompt is computed there
                log.warning("prefill round failed: %s: %s", type(e).__name__, e)
                for item in batch:
                    if not item.handed:
                        self._hand_over(item, [], (), e)

    def _run(self, batch: list[_Prefill]) -> None:
        from minikv.engine.sampling_params import SamplingParams

        prompts = [{"prompt_token_ids": it.ids, **({"cache_salt": it.salt} if it.salt is not None else {})}
                   for it in batch]
        for event in self.llm.stream(prompts, SamplingParams(max_tokens=1)):
            if event.finished:  # its blocks are in the prefix cache until the next step: read them now
                item = batch[event.index]
                self.prefilled += 1
                self._hand_over(item, *self.llm.core.export_prefix(item.ids, item.salt, on_device=self.on_device))

    def _hand_over(self, item: _Prefill, keys: list[bytes], planes: tuple, error: Exception | None = None) -> None:
        item.handed, item.error = True, error
        with self.cond:
            self.to_send.append((item, keys, planes))
            self.cond.notify_all()

    def _send_loop(self) -> None:
        while items := self._take(self.to_send):  # every prompt exported since the last transfer: one transfer
            try:
                sent = _send_blocks(self.channel, self.identity, [(it.tid, keys, planes) for it, keys, planes in items])
            except Exception as e:  # noqa: BLE001  the channel is broken: the decode side computes these prompts
                sent = [e] * len(items)
            self.transfers += 1
            for (item, _, _), n in zip(items, sent):
                error = n if isinstance(n, Exception) else item.error
                if error is not None:
                    self.failed += 1
                    item.done.set_exception(error)
                else:
                    self.sent_blocks += n
                    item.done.set_result(n)


def build_prefill_app(llm, channel: KVChannel):
    """The prefill server's routes: POST /kv/prefill {prompt_token_ids, cache_salt, transfer_id} queues the
    prompt for the next round of the engine and answers once its blocks are sent to the paired decode
    server; GET /health tells the channel's state and counts the rounds, prompts and blocks sent."""
    import asyncio
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = FastAPI(title="minikv prefill", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    batcher = app.state.batcher = PrefillBatcher(llm, channel)
    app.state.sent_blocks = 0

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if not channel.broken else "KV channel failed",
                             "rounds": batcher.rounds, "prefilled": batcher.prefilled, "transfers": batcher.transfers,
                             "sent_blocks": batcher.sent_blocks, "failed": batcher.failed},
                            status_code=200 if not channel.broken else 503)

    @app.post(PREFILL_ROUTE)
    async def prefill(request: Request) -> JSONResponse:
        body = await request.json()
        ids, salt, tid = body.get("prompt_token_ids"), body.get("cache_salt"), body.get("transfer_id")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return JSONResponse({"error": "'prompt_token_ids' must be a non-empty list of token ids"}, 400)
        if not isinstance(tid, int) or tid < 0:
            return JSONResponse({"error": "'transfer_id' must be a non-negative integer (the decode side's)"}, 400)
        try:
            sent = await asyncio.wrap_future(batcher.submit(ids, salt, tid))
        except Exception as e:  # noqa: BLE001  the decode side computes the prompt itself
            log.warning("prefill and send failed: %s: %s", type(e).__name__, e)
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, 500)
        app.state.sent_blocks += sent
        return JSONResponse({"sent_blocks": sent})

    return app


class DecodeSide:
    """The decode server's `before_submit`: a request that names its prefill server (the router's
    x-minikv-prefill header) has the prompt run there and its blocks received here before it is
    submitted; without the header, or when the transfer fails or takes longer than `timeout_s`, the
    prompt is computed here. Many transfers may be expected at once; one receiver thread takes them in
    the channel's order and hands each to its request by transfer id."""

    def __init__(self, llm, channel: KVChannel, timeout_s: float = DEFAULT_TIMEOUT_S):
        _need_inbox(llm)
        self.llm, self.channel, self.timeout_s = llm, channel, timeout_s
        self.expected: dict[int, tuple[list[int], str | None, Future]] = {}
        self.ids = itertools.count()
        self.cond = threading.Condition()
        self.received_blocks = self.transfers = 0
        self.asks: set = set()  # HTTP calls in flight (kept referenced)
        self.client = None  # one HTTP client, its connections kept open (a client per call costs a TLS context)
        self.receiver = threading.Thread(target=self._receive_loop, name="minikv-kv-receive", daemon=True)
        self.receiver.start()

    def _expect(self, ids: list[int], salt: str | None) -> tuple[int, Future]:
        done: Future = Future()
        with self.cond:
            tid = next(self.ids)
            self.expected[tid] = (ids, salt, done)
            self.cond.notify_all()
        return tid, done

    def _forget(self, tid: int) -> None:
        with self.cond:
            entry = self.expected.pop(tid, None)
        if entry is not None and not entry[2].done():
            entry[2].set_result(0)

    def _wanted(self, tid: int) -> tuple[list[int], str | None] | None:
        with self.cond:
            entry = self.expected.get(tid)
        return None if entry is None else entry[:2]

    def _receive_loop(self) -> None:
        while True:
            with self.cond:
                while not self.expected:  # a receive waits only while a transfer is expected
                    self.cond.wait()
            try:
                received = _receive_blocks(self.llm, self.channel, self._wanted)
            except Exception as e:  # noqa: BLE001  a timeout, a peer gone: these prompts are computed here
                self.channel.broken = True
                log.warning("KV transfer failed (%s: %s); the decode engine computes the prompts", type(e).__name__, e)
                with self.cond:
                    entries, self.expected = list(self.expected.values()), {}
                for _, _, done in entries:
                    done.set_result(0)
                return
            for tid, got in received:
                with self.cond:
                    entry = self.expected.pop(tid, None)
                if entry is not None:
                    entry[2].set_result(got)

    async def _ask(self, url: str, ids: list[int], salt: str | None, tid: int) -> None:
        import httpx

        if self.client is None:
            self.client = httpx.AsyncClient(trust_env=False, timeout=self.timeout_s,
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            r = await self.client.post(url.rstrip("/") + PREFILL_ROUTE,
                                       json={"prompt_token_ids": ids, "cache_salt": salt, "transfer_id": tid})
            if r.status_code == 200:
                return
            log.warning("prefill server %s answered %d (%s): computing the prompt here", url, r.status_code, r.text)
        except httpx.HTTPError as e:
            log.warning("prefill server %s did not answer (%s): computing the prompt here", url, e)
        self._forget(tid)  # its head, if one still comes, is answered "nothing wanted"

    async def __call__(self, headers, ids: list[int], salt: str | None) -> None:
        import asyncio

        from minikv.serve.router import PREFILL_HEADER

        url = headers.get(PREFILL_HEADER)
        if not url or self.channel.broken:
            return
        tid, done = self._expect(ids, salt)
        ask = asyncio.ensure_future(self._ask(url, ids, salt, tid))
        self.asks.add(ask)
        ask.add_done_callback(self.asks.discard)
        try:
            received = await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("no KV blocks within %.0f s for transfer %d: computing the prompt here", self.timeout_s, tid)
            self._forget(tid)
            received = 0
        self.received_blocks += received
        self.transfers += 1


def serve_role(role: str, llm, kv_address: str, host: str, port: int, served_name: str, log_level: str = "info",
               timeout_s: float = 600.0, **serve_options) -> None:
    """`minikv serve --role prefill|decode --kv-address HOST:PORT`: join the pair (the prefill server is
    rank 0 and listens at HOST:PORT; each waits up to `timeout_s` for the other), then serve in the
    foreground: the prefill server its /kv/prefill route, the decode server the OpenAI API."""
    import uvicorn

    from minikv.serve.app import run

    print(f"minikv: {role} server waiting for its pair at {kv_address}", flush=True)
    channel = KVChannel.connect(kv_address, 0 if role == "prefill" else 1, timeout_s, llm.core.device)
    if role == "prefill":
        print(f"minikv: prefill server at http://{host}:{port}{PREFILL_ROUTE}", flush=True)
        uvicorn.Server(uvicorn.Config(build_prefill_app(llm, channel), host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=2)).run()
        return
    print(f"minikv: decode server {served_name!r} at http://{host}:{port}/v1", flush=True)
    run(llm, host, port, served_name, log_level=log_level, before_submit=DecodeSide(llm, channel), **serve_options)
