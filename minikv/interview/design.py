"""Back-of-the-envelope calculators for system-design questions: KV bytes under tensor parallelism,
the pool a GPU can hold, the batch that fits, and the step time its bytes and FLOPs bound.

    d = Deployment(MODELS["Llama-3-70B"], GPUS["H100-SXM"], num_gpus=8, tp=8)
    d.kv_bytes_per_token_per_gpu      K/V of one token on one GPU (KV heads split by TP, replicated past it)
    d.pool_tokens_per_replica         tokens of KV one model replica holds after weights and activations
    d.max_sequences(8192)             concurrent sequences of 8k tokens, all replicas together
    d.decode_step_seconds(64, 4096)   lower bound of one decode step: max(bytes / HBM bandwidth, FLOPs / peak)

Every figure is a lower bound on time and an upper bound on capacity: real engines lose 10-30% to
kernel efficiency, communication, CUDA graphs and fragmentation (the worksheet notebook says where).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minikv.model.shapes import GIB, MODELS, ModelShape, format_bytes  # noqa: F401  (re-exported for the notebook)

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float  # what the card has (an "80 GB" H100 holds 80 GiB)
    hbm_bytes_per_s: float  # peak HBM bandwidth
    bf16_flops: float  # dense bf16 peak


GPUS = {g.name: g for g in (
    GPU("H100-SXM", 80 * GIB, 3.35e12, 989e12),
    GPU("H200", 141 * GB, 4.8e12, 989e12),
    GPU("A100-80GB", 80 * GIB, 2.0e12, 312e12),
)}


@dataclass(frozen=True)
class Deployment:
    model: ModelShape
    gpu: GPU
    num_gpus: int = 1
    tp: int = 1  # tensor parallelism: GPUs per model replica
    weight_bytes: int = 2  # bf16
    kv_bytes: int = 2  # bf16; 1 for fp8 / int8
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization
    activation_bytes_per_gpu: float = 4 * GIB  # what the profiling run finds (activations, buffers, graphs)

    def __post_init__(self) -> None:
        if self.num_gpus % self.tp:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of tp={self.tp}; each replica takes tp GPUs")

    @property
    def replicas(self) -> int:
        return self.num_gpus // self.tp

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads each GPU stores: split by TP, but at least one (replicated when tp > kv heads)."""
        return max(1, math.ceil(self.model.num_kv_heads / self.tp))

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.kv_heads_per_gpu * m.head_dim * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V of one token across the GPUs of one replica (more than the model's own when replicated)."""
        return self.kv_bytes_per_token_per_gpu * self.tp

    @property
    def weights_per_gpu(self) -> float:
        return self.model.num_params * self.weight_bytes / self.tp

    @property
    def pool_bytes_per_gpu(self) -> float:
        """The KV budget: utilization x memory - weights - activations (vLLM's profiling run), never < 0."""
        return max(0.0, self.memory_utilization * self.gpu.memory_bytes - self.weights_per_gpu
                   - self.activation_bytes_per_gpu)

    @property
    def pool_tokens_per_replica(self) -> int:
        return int(self.pool_bytes_per_gpu // self.kv_bytes_per_token_per_gpu)

    def max_sequences(self, tokens_per_sequence: int, block_size: int = 16) -> int:
        """Sequences of this length that fit at once, over every replica (whole blocks per sequence)."""
        blocks = self.pool_tokens_per_replica // block_size
        return self.replicas * (blocks // math.ceil(tokens_per_sequence / block_size))

    def decode_step_bytes_seconds(self, batch: int, context: int) -> float:
        """One decode step's bytes over HBM bandwidth: every weight and every cached token read once
        (per GPU, in parallel)."""
        per_gpu = self.weights_per_gpu + batch * context * self.kv_bytes_per_token_per_gpu
        return per_gpu / self.gpu.hbm_bytes_per_s

    def decode_step_flops(self, batch: int, context: int) -> float:
        """One decode step's FLOPs over the replica: 2 per parameter per sequence (the matmuls), plus
        attention, QK^T and PV over each sequence's context: 2 x 2 x layers x heads x head_dim x context."""
        m = self.model
        return batch * (2 * m.num_params + 4 * m.num_layers * m.num_heads * m.head_dim * context)

    def decode_step_compute_seconds(self, batch: int, context: int) -> float:
        """One decode step's FLOPs at the replica's peak (fp8 weights run on fp8 tensor cores, twice bf16's)."""
        peak = self.gpu.bf16_flops * (2 if self.weight_bytes == 1 else 1)
        return self.decode_step_flops(batch, context) / (self.tp * peak)

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """Lower bound of one decode step of one replica: it can go no faster than its bytes allow nor
        than its FLOPs allow, max(bytes / HBM bandwidth, FLOPs / peak). A few sequences read far more
        than they compute; a few hundred per replica bring the FLOPs level (notebook 05)."""
        return max(self.decode_step_bytes_seconds(batch, context), self.decode_step_compute_seconds(batch, context))

    def prefill_flops(self, tokens: int) -> float:
        """2 FLOPs per parameter per token (the matmuls), plus causal attention: QK^T and PV over the
        keys before each token, 2 x 2 x layers x heads x head_dim x tokens^2 / 2."""
        m = self.model
        return 2 * m.num_params * tokens + 2 * m.num_layers * m.num_heads * m.head_dim * tokens ** 2

    def prefill_seconds(self, tokens: int, mfu: float = 0.5) -> float:
        """Compute-bound estimate of one prompt's prefill at `mfu` of the replica's peak."""
        return self.prefill_flops(tokens) / (self.tp * self.gpu.bf16_flops * mfu)

    def kv_transfer_seconds(self, tokens: int, link_bytes_per_s: float) -> float:
        """Time to move a prompt's KV between machines (prefill/decode disaggregation)."""
        return tokens * self.kv_bytes_per_token / link_bytes_per_s


def littles_law(arrival_per_s: float, seconds_in_system: float) -> float:
    """Requests in flight on average: L = lambda x W."""
    return arrival_per_s * seconds_in_system


def worksheet_lines(d: Deployment, context: int, batch: int) -> list[str]:
    """The calculators' answer for one deployment, as lines (the notebook shows them; tests read them)."""
    step = d.decode_step_seconds(batch, context)
    by_bytes, by_flops = d.decode_step_bytes_seconds(batch, context), d.decode_step_compute_seconds(batch, context)
    return [
        f"{d.model.name} on {d.num_gpus} x {d.gpu.name}, TP {d.tp} ({d.replicas} replica(s)), weights "
        f"{d.weight_bytes} B, KV {d.kv_bytes} B per number",
        f"KV heads per GPU: {d.kv_heads_per_gpu} of {d.model.num_kv_heads}"
        + (" (replicated: TP exceeds the KV heads)" if d.tp > d.model.num_kv_heads else ""),
        f"KV per token: {format_bytes(d.kv_bytes_per_token_per_gpu)} per GPU, {format_bytes(d.kv_bytes_per_token)} "
        f"per replica",
        f"per GPU: weights {format_bytes(d.weights_per_gpu)}, KV pool {format_bytes(d.pool_bytes_per_gpu)} "
        f"(utilization {d.memory_utilization}, activations {format_bytes(d.activation_bytes_per_gpu)})",
        f"pool: {d.pool_tokens_per_replica:,} tokens per replica; {d.max_sequences(context):,} sequences of "
        f"{context:,} tokens in all",
        f"decode step at batch {batch} x {context:,} tokens: >= {step * 1e3:.1f} ms "
        f"({batch / step:,.0f} tokens/s per replica at best; bytes {by_bytes * 1e3:.1f} ms, FLOPs at peak "
        f"{by_flops * 1e3:.1f} ms)",
    ]
