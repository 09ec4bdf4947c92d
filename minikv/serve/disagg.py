"""Rung 13, prefill and decode on separate engines: the prompt's KV blocks are sent between them.

A long prompt's prefill stalls every other user's next token on the same engine (one step runs both).
Disaggregation (DistServe, Splitwise, Mooncake; vLLM's and SGLang's prefill/decode connectors) runs
prompts on a prefill engine and the token-by-token decode on another, and sends the prompt's KV
blocks across. Here the decode engine admits the request through the prefix cache it already has:

    prefill engine                                      decode engine (kv_offload_store=Inbox())
    --------------                                      ----------------------------------------
    run the prompt (max_tokens=1): its full blocks
    join the prefix cache
    identity, keys of its n full blocks  ---------->    another identity (model, dtype, pool format)? -1
                                                        else: leading blocks held, in the pool or inbox
                                         <----------    held
    blocks [held, n), one tensor a plane ---------->    inbox[key] = block
                                                        submit the request as usual: the prefix cache hits
                                                        what it held, the offload seam finds the rest in
                                                        the inbox and copies it into the pool (rung 9),
                                                        and only the tail (at least the last token) runs

A key is identity.store_key(engine identity, hash chain key): the chain key covers every token before
and the cache salt, the identity the weights, dtype and pool format. So a block never lands in the
wrong tenant's or the wrong model's cache: it would never be looked up there. The transport is
torch.distributed point-to-point (gloo between CPUs, NCCL between GPUs) on a process group of two
ranks of its own (the default group stays free for tensor parallelism). A transfer that fails or
times out sends nothing usable: the decode engine computes the prompt itself.

    prefill, decode = LLM(...), LLM(..., kv_offload_store=Inbox())
    a, b = KVChannel.pair()                        # two ranks in one process (tests); connect() across processes
    thread: send_prefill(prefill, a, ids)          # decode side: receive_prefill(decode, b, ids)
"""
from __future__ import annotations

import datetime
import logging
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("minikv.disagg")
KEY_BYTES = 32  # identity.store_key: sha256
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
REFUSED = -1  # the decode engine's answer when the identities differ


class Inbox:
    """The decode engine's store of received blocks (a `kv_offload_store`: put, get, in), least recently
    used dropped first past `capacity` blocks. Blocks the decode engine's pool evicts land here too,
    as in a CPU tier."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"Inbox capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, tuple] = OrderedDict()
        self.received = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, value: tuple) -> None:
        with self._lock:
            self.blocks[key] = tuple(t.clone() for t in value)
            self.blocks.move_to_end(key)
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)

    def get(self, key: bytes) -> tuple | None:
        with self._lock:
            value = self.blocks.get(key)
            if value is not None:
                self.blocks.move_to_end(key)
            return value

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)


class KVChannel:
    """One end of a two-rank process group for KV blocks (rank 0 prefill, rank 1 decode): tensors sent
    and received in order, each side waiting at most `timeout_s`."""

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

    def send(self, t: torch.Tensor) -> None:
        self.group.send([t.to(self.device).contiguous()], self.peer, 0).wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.group.recv([t], self.peer, 0).wait()
        return t.cpu()

    def send_ints(self, values: list[int]) -> None:
        self.send(torch.tensor([len(values)], dtype=torch.int64))
        if values:
            self.send(torch.tensor(values, dtype=torch.int64))

    def recv_ints(self) -> list[int]:
        (n,) = self.recv((1,), torch.int64).tolist()
        return self.recv((n,), torch.int64).tolist() if n else []


def _key_tensor(keys: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).reshape(len(keys), KEY_BYTES)


def send_prefill(llm, channel: KVChannel, ids: list[int], salt: str | None = None) -> int:
    """(Prefill side.) Run the prompt, then send its blocks the decode engine does not hold. Returns the
    number of blocks sent; 0 when the decode engine refused (another model) or held them all."""
    from minikv.engine.sampling_params import SamplingParams

    if channel.broken:
        raise RuntimeError("this KV channel failed before and is out of step; connect a new one")
    llm.generate([{"prompt_token_ids": ids, "cache_salt": salt} if salt is not None else ids],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    keys, planes = llm.core.export_prefix(ids, salt)
    try:
        channel.send(torch.frombuffer(bytearray(bytes.fromhex(llm.core.kv_identity())), dtype=torch.uint8))
        channel.send_ints([len(keys)])
        if keys:
            channel.send(_key_tensor(keys))
        (held,) = channel.recv_ints()
        if held == REFUSED or held >= len(keys):
            return 0
        meta = [len(planes)]
        for p in planes:
            meta += [DTYPES.index(p.dtype), p.dim(), *p.shape[:1], len(keys) - held, *p.shape[2:]]
        channel.send_ints(meta)
        for p in planes:
            channel.send(p[:, held:])
        return len(keys) - held
    except Exception:
        channel.broken = True
        raise


def receive_prefill(llm, channel: KVChannel, ids: list[int], salt: str | None = None) -> int:
    """(Decode side, an LLM built with kv_offload_store=Inbox().) Take the blocks the prefill engine sends
    into the inbox; the request submitted next finds them. Returns the number of blocks received; 0 on a
    refusal or a failed or timed-out transfer (logged): the decode engine then computes the prompt."""
    inbox = llm.engine_config.kv_offload_store
    if not isinstance(inbox, Inbox):
        raise ValueError("the decode engine takes blocks into an Inbox: build it with kv_offload_store=Inbox()")
    if channel.broken:
        return 0
    try:
        identity = bytes(channel.recv((KEY_BYTES,), torch.uint8).tolist()).hex()
        (n,) = channel.recv_ints()
        keys = [bytes(row.tolist()) for row in channel.recv((n, KEY_BYTES), torch.uint8)] if n else []
        if identity != llm.core.kv_identity():
            channel.send_ints([REFUSED])
            log.warning("refused %d KV blocks from an engine of another identity (model, dtype or pool format)", n)
            return 0
        held = llm.core.held_prefix_blocks(ids, salt)
        while held < n and keys[held] in inbox:
            held += 1
        channel.send_ints([held])
        if held >= n:
            return 0
        meta = channel.recv_ints()
        planes, at = [], 1
        for _ in range(meta[0]):
            dtype, ndim = DTYPES[meta[at]], meta[at + 1]
            shape = tuple(meta[at + 2:at + 2 + ndim])
            planes.append(channel.recv(shape, dtype))
            at += 2 + ndim
        for j, key in enumerate(keys[held:]):
            inbox.put(key, tuple(p[:, j] for p in planes))
        inbox.received += n - held
        return n - held
    except Exception as e:  # noqa: BLE001  a timeout, a peer gone: the prompt is computed here instead
        channel.broken = True
        log.warning("KV transfer failed (%s: %s); the decode engine computes the prompt", type(e).__name__, e)
        return 0


# ---- serving: `minikv serve --role prefill|decode`, `minikv route --prefill URL --decode URL` -------

PREFILL_ROUTE = "/kv/prefill"


def build_prefill_app(llm, channel: KVChannel):
    """The prefill server's routes: POST /kv/prefill {prompt_token_ids, cache_salt} runs the prompt and
    sends its blocks to the paired decode server (one at a time: both ends see transfers in one order)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    app = FastAPI(title="minikv prefill", docs_url=None, redoc_url=None, openapi_url=None)
    worker = ThreadPoolExecutor(1, thread_name_prefix="minikv-prefill")  # the engine and the channel: one user
    app.state.sent_blocks = 0

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok" if not channel.broken else "KV channel failed"},
                            status_code=200 if not channel.broken else 503)

    @app.post(PREFILL_ROUTE)
    async def prefill(request: Request) -> JSONResponse:
        body = await request.json()
        ids, salt = body.get("prompt_token_ids"), body.get("cache_salt")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return JSONResponse({"error": "'prompt_token_ids' must be a non-empty list of token ids"}, 400)
        try:
            sent = await asyncio.get_running_loop().run_in_executor(worker, send_prefill, llm, channel, ids, salt)
        except Exception as e:  # noqa: BLE001  the decode side times out and computes the prompt itself
            log.warning("prefill and send failed: %s: %s", type(e).__name__, e)
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, 500)
        app.state.sent_blocks += sent
        return JSONResponse({"sent_blocks": sent})

    return app


class DecodeSide:
    """The decode server's `before_submit`: a request that names its prefill server (the router's
    x-minikv-prefill header) has the prompt run there and its blocks received here before it is
    submitted; without the header, or when the transfer fails, the prompt is computed here."""

    def __init__(self, llm, channel: KVChannel, timeout_s: float = DEFAULT_TIMEOUT_S):
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        self.llm, self.channel, self.timeout_s = llm, channel, timeout_s
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="minikv-receive")
        self.lock = asyncio.Lock()
        self.received_blocks = self.transfers = 0

    async def __call__(self, headers, ids: list[int], salt: str | None) -> None:
        import asyncio

        import httpx

        from minikv.serve.router import PREFILL_HEADER

        url = headers.get(PREFILL_HEADER)
        if not url or self.channel.broken:
            return
        loop = asyncio.get_running_loop()
        async with self.lock:  # one transfer at a time on the channel
            received = loop.run_in_executor(self.worker, receive_prefill, self.llm, self.channel, ids, salt)
            try:
                async with httpx.AsyncClient(trust_env=False, timeout=self.timeout_s) as client:
                    await client.post(url.rstrip("/") + PREFILL_ROUTE,
                                      json={"prompt_token_ids": ids, "cache_salt": salt})
            except httpx.HTTPError as e:
                log.warning("prefill server %s did not answer (%s): computing the prompt here", url, e)
            self.received_blocks += await received
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
