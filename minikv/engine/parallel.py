"""Tensor parallelism in the engine: N processes, one scheduler, torch.distributed between them.

    LLM(model, tensor_parallel_size=N)

    rank 0 = the engine's own process                 ranks 1 .. N-1 = workers spawned by it
    scheduler, block manager, sampler, its pool      the same weights' slices, their own pools
      step: schedule -> prepare ----- step description ----->  receive
            forward (its slice)  <==== all-reduce x 2 per layer ====>  forward (their slices)
            sample (logits on rank 0 only)

Each rank holds its own K/V heads (minikv/model/tensor_parallel.py) in a pool of the same number of
blocks, so the block tables rank 0's block manager writes are right on every rank: the step
description is only what the model needs, the same arrays rank 0 copies to its own device:

    input_ids [T]  positions [T]  query_start_loc [B+1]  seq_lens [B]
    block_tables [B, max_blocks]  slot_mapping [T]  blocks_to_copy [(src, dst), ...] (copy-on-write)

The description travels through a pipe to each worker (as vLLM sends its scheduler output through a
shared-memory queue), not through a collective: a worker waits for the next step as long as the
engine sits idle, while every collective of torch.distributed times out. The all-reduces of the
model go through torch.distributed: gloo on CPUs (a laptop runs TP = 2), NCCL on GPUs (rank r on
cuda:r).

Faults. A worker that dies breaks its connections: rank 0's pipe write or next all-reduce fails at
once. A worker that hangs leaves rank 0 waiting in an all-reduce until `tensor_parallel_timeout`
seconds have passed: gloo then raises; NCCL's watchdog ends the stuck collective (by default taking
the process down with it, which the tests on CPUs cannot show). On a raise, the engine raises
TensorParallelError naming the rank, kills every worker (the OS takes back their memory), frees its
own pool and tears the group down; the engine is then closed for good (build a new LLM).

What runs under TP: the paged engine, prefix caching, recompute preemption, forks and beams (their
copy-on-write copies travel in the description), sliding windows, fused ops. What is refused with a
clear error (minikv/engine/config.py): swap preemption and the offload tiers (blocks would have to
move on every rank), quantized KV, CUDA graphs and the overlapped step (the workers would need to
replay and be fed in step), and the rung-1/2 backends.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from minikv.attention.metadata import BatchInputs
from minikv.cache.blocks.pool import KVPool
from minikv.engine.runner import ModelRunner
from minikv.model.config import ModelConfig
from minikv.model.dtype import parse_dtype
from minikv.model.llama import LlamaForCausalLM
from minikv.model.loader import LoadedModel, load_model, read_config, read_state_dict, resolve, uninitialised_weights
from minikv.model.tensor_parallel import HeadShard, ShardHeadsFn, shard_all, shard_heads, shard_model

DEFAULT_TIMEOUT_S = 60.0  # a collective (an all-reduce) waits this long for a silent rank
START_TIMEOUT_S = 600.0  # a worker's start (imports, weights) may take this long on a busy machine
_live: list = []  # the group running in this process (torch.distributed has one default group per process)


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed; the engine cannot go on."""


@dataclass(frozen=True)
class PoolSpec:
    """What a worker needs to build its pool and attention: the same sizes as rank 0's."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str | None
    attention: str
    sliding_window: int | None
    sink_tokens: int


@dataclass(frozen=True)
class WorkerSpec:
    source: str
    rank: int
    world_size: int
    device: str
    dtype: str
    port: int
    timeout_s: float
    backend: str
    shard: HeadShard
    fused_ops: bool
    num_threads: int  # torch threads of a CPU worker: its share of rank 0's, so N ranks do not oversubscribe


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def pool_stats(rank: int, pool: KVPool, shard: HeadShard) -> dict:
    """One rank's share: its heads and its pool's bytes (what each rank's stats() reports)."""
    return {"rank": rank, "pid": os.getpid(), "kv_heads": list(shard.kv_heads), "q_heads": list(shard.q_heads),
            "num_kv_heads": pool.num_kv_heads, "num_blocks": pool.num_blocks, "bytes_per_token": pool.bytes_per_token,
            "pool_bytes": pool.block_bytes * pool.num_blocks}


def make_backend(spec: PoolSpec, dtype: torch.dtype, device: torch.device):
    pool = KVPool(spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, dtype, device,
                  spec.kv_layout)
    if spec.attention == "triton":
        from minikv.attention.triton_backend import TritonPagedBackend as backend_cls
    else:
        from minikv.attention.paged import PagedBackend as backend_cls
    return pool, backend_cls(pool, spec.sliding_window, spec.sink_tokens)


def inputs_from_host(host: dict[str, np.ndarray], device: torch.device) -> BatchInputs:
    """The step description as the model's inputs on this rank's device (no logits: rank 0 samples)."""
    t = {k: torch.from_numpy(v).to(device) for k, v in host.items() if k not in ("logits_indices", "fed_dst",
                                                                                  "fed_src")}
    seq_lens = host["seq_lens"].tolist()
    return BatchInputs(**t, query_lens_list=np.diff(host["query_start_loc"]).tolist(), seq_lens_list=seq_lens,
                       max_seq_len=max(seq_lens), logits_indices=torch.empty(0, dtype=torch.long, device=device))


def _load_weights(source: str, device: torch.device, dtype: str):
    """The model as `load_model` builds it, without the tokenizer (rank 0 alone turns text into ids)."""
    ckpt, raw = resolve(source)
    if ckpt is None:  # tiny-random: built in code from its seed
        return load_model(source, device, dtype).model
    cfg = ModelConfig.from_hf(read_config(ckpt), source=str(ckpt / "config.json"))
    with uninitialised_weights():
        model = LlamaForCausalLM(cfg)
    state = {k: v for k, v in read_state_dict(ckpt).items() if "rotary_emb" not in k}
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    return model.to(device=device, dtype=parse_dtype(dtype, device)).eval()


def _worker_main(spec: WorkerSpec, conn) -> None:
    """Rank 1 .. N-1: join the group, load and cut the weights, build the pool, then run every step
    rank 0 describes until it says close (or its pipe ends: rank 0 is gone)."""
    try:
        conn.send(("started", os.getpid()))
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.num_threads)
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        model = _load_weights(spec.source, device, spec.dtype)
        shard_model(model, spec.shard, spec.rank, spec.world_size, _all_reduce, keep_lm_head=False)
        model.fused_ops = spec.fused_ops
        conn.send(("ready", None))
        _, pool_spec = conn.recv()
        pool, backend = make_backend(pool_spec, next(model.parameters()).dtype, device)
        conn.send(("pool", None))
        with torch.inference_mode():
            while True:
                msg = conn.recv()
                if msg[0] == "step":
                    _, host, copies = msg
                    if copies:
                        pool.copy_blocks(copies)
                    inputs = inputs_from_host(host, device)
                    model(inputs.input_ids, inputs.positions, backend.prepare_metadata(inputs), backend,
                          logits_indices=inputs.logits_indices)
                elif msg[0] == "stats":
                    conn.send(("stats", pool_stats(spec.rank, pool, spec.shard)))
                elif msg[0] == "close":
                    break
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # rank 0 is gone or stopping us
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(procs: list, conns: list, kill: bool) -> None:
    """End the workers (asked first, killed if they do not go), and the group on this side."""
    for conn in conns:
        try:
            if not kill:
                conn.send(("close",))
        except Exception:
            pass
    for p in procs:
        if kill:
            p.kill()
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    for conn in conns:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _live.clear()


def _context(device: torch.device):
    """Where workers come from. On a CPU: a fork server that imported torch and minikv once (each later
    worker is a fork of it, in milliseconds instead of seconds). On GPUs, and where there is no fork
    server: a fresh interpreter each (spawn), since a process that has touched the CUDA driver must not
    be forked. Never a fork of rank 0 itself, whose threads a fork would copy half-way."""
    if device.type == "cpu" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["minikv.engine.parallel"])
        return ctx
    return mp.get_context("spawn")


def _start_child(proc) -> None:
    """Start a worker, also from a daemonic process (the server's engine process is one, and
    multiprocessing refuses children there lest they outlive it): ours cannot, since a worker ends
    when its pipe to this process closes."""
    me = mp.current_process()
    daemonic = me.daemon
    me.daemon = False
    try:
        proc.start()
    finally:
        me.daemon = daemonic


class TensorParallelGroup:
    """Rank 0's handle on the workers: start them, describe each step to them, ask their stats, end them."""

    def __init__(self, source: str, world_size: int, device: torch.device, dtype: torch.dtype, timeout_s: float,
                 shards: list[HeadShard], fused_ops: bool):
        if _live:
            raise ValueError("a tensor-parallel engine is already running in this process (torch.distributed holds "
                             "one group per process); close() it before building another")
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process; minikv starts its own group "
                             "for tensor_parallel_size > 1 (run the engine outside torchrun, one process)")
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"tensor parallelism puts rank r on cuda:r, so rank 0 runs on cuda:0, but device is "
                             f"{device}; pass device='cuda' (restrict the cards with CUDA_VISIBLE_DEVICES)")
        self.world_size, self.timeout_s, self.shards = world_size, timeout_s, shards
        self.failure: str | None = None
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        ctx = _context(device)
        self.procs, self.conns = [], []
        _live.append(self)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, False)
        try:
            for rank in range(1, world_size):
                spec = WorkerSpec(source, rank, world_size, f"cuda:{rank}" if device.type == "cuda" else "cpu",
                                  str(dtype).removeprefix("torch."), store.port, timeout_s, backend, shards[rank],
                                  fused_ops, max(1, torch.get_num_threads() // world_size))
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(spec, child), name=f"minikv-tp-rank{rank}", daemon=True)
                _start_child(proc)
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._expect("started", START_TIMEOUT_S)
            dist.init_process_group(backend, store=store, rank=0, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except BaseException:
            self._finalizer.detach()
            _shutdown(self.procs, self.conns, kill=True)
            raise

    def _expect(self, kind: str, timeout_s: float) -> list:
        """Each worker's next message, which must be `kind`; a worker that exits, errs or stays silent
        for timeout_s fails the group."""
        out, deadline = [], time.monotonic() + timeout_s
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if proc.exitcode is not None and not conn.poll(0.05):
                    raise self.fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} before it "
                                    f"answered {kind!r}")
                if time.monotonic() > deadline:
                    raise self.fail(f"rank {rank} (pid {proc.pid}) did not answer {kind!r} within {timeout_s:.0f} s")
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise self.fail(f"rank {rank} (pid {proc.pid}) closed its pipe before it answered {kind!r}") from None
            if msg[0] == "error":
                raise self.fail(f"rank {rank} (pid {proc.pid}) failed:\n{msg[1]}")
            if msg[0] != kind:
                raise self.fail(f"rank {rank} answered {msg[0]!r}, expected {kind!r}")
            out.append(msg[1])
        return out

    def wait_ready(self) -> None:
        """The workers loaded and cut their weights."""
        self._expect("ready", START_TIMEOUT_S)

    def build_pools(self, spec: PoolSpec) -> None:
        """Every worker builds a pool of the same blocks as rank 0's."""
        self.send(("pool", spec))
        self._expect("pool", START_TIMEOUT_S)

    def send(self, msg: tuple) -> None:
        """The same message to every worker (a step description, a question)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if proc.exitcode is not None:
                raise self.fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
            try:
                conn.send(msg)
            except OSError as e:
                raise self.fail(f"rank {rank} (pid {proc.pid}) cannot be reached ({type(e).__name__})") from None

    def worker_stats(self) -> list[dict]:
        self.send(("stats",))
        return self._expect("stats", self.timeout_s)

    def fail(self, why: str) -> TensorParallelError:
        """Tear the group down after a fault: every worker killed (the OS takes back its memory), the
        process group destroyed. Returns the error to raise."""
        if self.failure is None:
            notes = []
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
                try:
                    while conn.poll(0):
                        msg = conn.recv()
                        if msg[0] == "error":
                            notes.append(f"rank {rank} reported:\n{msg[1]}")
                except (EOFError, OSError):
                    pass
                if proc.exitcode is not None:
                    notes.append(f"rank {rank} (pid {proc.pid}) exit code {proc.exitcode}")
            self.failure = (f"the tensor-parallel group of {self.world_size} ranks failed: {why}"
                            + ("".join(f"; {n}" for n in notes)) + ". Every worker is ended and every rank's memory "
                            "released; this engine is closed for good: build a new LLM")
            self._finalizer.detach()
            _shutdown(self.procs, self.conns, kill=True)
        return TensorParallelError(self.failure)

    @property
    def alive(self) -> bool:
        return self.failure is None and self._finalizer.alive

    def close(self) -> None:
        """Ask every worker to stop, wait for them, destroy the group. Idempotent."""
        if self._finalizer.alive:
            self._finalizer()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: before each forward, the step's description goes to every worker; the forward
    itself is the ordinary one, on the cut model whose o_proj and down_proj all-reduce."""

    def __init__(self, *args, group: TensorParallelGroup, shard: HeadShard, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.shard = group, shard
        self._host: dict[str, np.ndarray] | None = None

    def _to_device(self, host: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        self._host = host  # the step description: the same arrays rank 0 copies to its device
        return super()._to_device(host)

    def forward(self, batch, prepared, fed_ids=None) -> torch.Tensor:
        if prepared.fed_dst is not None or self._host is None:
            raise TensorParallelError("a tensor-parallel step must be prepared just before it runs (the overlapped "
                                      "step is not supported under tensor parallelism)")
        host, self._host = self._host, None
        try:
            self.group.send(("step", host, list(batch.blocks_to_copy or ())))
            return super().forward(batch, prepared, fed_ids)
        except TensorParallelError:
            self.pool.close()  # the group is down: rank 0's pool goes too (the workers' went with them)
            raise
        except BaseException as e:  # the ranks are out of step now: the group cannot go on
            self.pool.close()
            err = self.group.fail(f"rank 0's step failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
            if isinstance(e, Exception):
                raise err from e
            raise

    def stats(self) -> dict:
        """The group's size and each rank's heads and pool (rank 0's own, the workers' by asking them)."""
        ranks = [pool_stats(0, self.pool, self.shard)] + (self.group.worker_stats() if self.group.alive else [])
        return {"size": self.group.world_size, "alive": self.group.alive, "ranks": ranks}

    def close(self) -> None:
        super().close()
        self.group.close()


def start_tensor_parallel(source, loaded: LoadedModel, world_size: int, device: torch.device, dtype: torch.dtype,
                          timeout_s: float, fused_ops: bool, shard_fn: ShardHeadsFn | None = None
                          ) -> tuple[TensorParallelGroup, LoadedModel]:
    """Spawn the workers and cut rank 0's weights to its slice. Returns the group and rank 0's model
    (its config gives the local head counts, which the engine's pool is built from)."""
    if not isinstance(source, str):
        raise ValueError("tensor_parallel_size > 1 needs the model as a name or a path (each rank loads its own "
                         f"slice of the weights), got {type(source).__name__}; pass e.g. 'smollm2-135m'")
    c = loaded.config
    shards = shard_all(c.num_heads, c.num_kv_heads, world_size, shard_fn or shard_heads)
    group = TensorParallelGroup(source, world_size, device, dtype, timeout_s, shards, fused_ops)
    try:
        local = shard_model(loaded.model, shards[0], 0, world_size, _all_reduce)
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    return group, LoadedModel(loaded.model, local, loaded.tokenizer, loaded.source)


def pool_spec(cfg, local) -> PoolSpec:
    """The workers' pool: rank 0's sizes (a fitted EngineConfig, the local model config)."""
    return PoolSpec(local.num_layers, cfg.num_blocks, cfg.block_size, local.num_kv_heads, local.head_dim,
                    cfg.kv_layout, cfg.attention, cfg.sliding_window, cfg.sink_tokens)


def tensor_parallel_engine(source, loaded: LoadedModel, cfg) -> tuple[LoadedModel, object, object]:
    """Rank 0's side of `LLM(model, tensor_parallel_size=N)`: the workers started, every rank's weights
    cut, the config fitted to rank 0's share of the heads, every worker's pool built like rank 0's.
    Returns (rank 0's model, the fitted config, the runner class for EngineCore)."""
    from minikv.engine.core import fit_to_model

    group, local = start_tensor_parallel(source, loaded, cfg.tensor_parallel_size, cfg.device, cfg.dtype,
                                         cfg.tensor_parallel_timeout, cfg.fused_ops, cfg.shard_heads)
    try:
        if cfg.device.type == "cuda":  # the weights rank 0 cut away count as free memory for its pool
            torch.cuda.empty_cache()
        cfg = fit_to_model(cfg, local)
        group.build_pools(pool_spec(cfg, local.config))
    except BaseException:
        group.close()
        raise
    return local, cfg, partial(TensorParallelRunner, group=group, shard=group.shards[0])
