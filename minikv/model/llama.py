"""A Llama-family decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model works on ONE flattened batch of tokens (all sequences of the step laid end to end):

    input_ids  [T]          T = total new tokens this step, over every sequence
    positions  [T]          each token's position inside its own sequence (for RoPE)
    meta                    AttentionMetadata: where each sequence starts, its cache, ...
    backend                 the attention backend that reads and writes the KV cache

Parameter names match Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint's state dict loads as it is. Llama, Mistral and Qwen2 differ only in config values.

Two forwards compute the same thing. The torch one, written op by op, is the reference. With
`model.fused_ops = True` (the engine's default on a GPU) each layer runs the fused path instead:

    torch (reference)                              fused (minikv/kernels/fused_*.py)
    RMSNorm                  ~8 elementwise ops    fused_add_rms_norm   add + norm, 1 kernel
    q_proj, k_proj, v_proj   3 matmuls             one matmul on the merged [q; k; v] weight
    apply_rope on q and k    ~12 ops + cos/sin     rotary_qkv           split + rotate, 1 kernel
    residual add + RMSNorm   ~9 ops                fused_add_rms_norm   1 kernel
    gate_proj, up_proj       2 matmuls             one matmul on the merged [gate; up] weight
    silu(gate) * up          2 ops                 silu_and_mul         1 kernel

The merged weights are not copies: q/k/v_proj.weight (and gate/up_proj.weight) are row slices of
one matrix (`merge_linears`, done when the model is built and after every move), so the memory is
not doubled, the torch path reads the same numbers, and the Hugging Face names still load, save and
tie as before.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from minikv.attention.metadata import AttentionMetadata
from minikv.model.config import ModelConfig

MM_OUT_DTYPE = TorchVersion(torch.__version__) >= (2, 8)  # torch.mm(..., out_dtype=) on CUDA (the LM head)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 rope scaling when the config asks."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]. Rotates the two halves (HF convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


_uninitialised = False  # inside uninitialised_weights(): new layers' parameters hold no values yet


@contextlib.contextmanager
def uninitialised_weights():
    """Linear and embedding layers built in here skip their random initialisation (their memory is left
    as allocated), as transformers does before it loads a checkpoint: drawing 135M random numbers that
    the checkpoint then overwrites took 1.6 s of SmolLM2's 2 s of model building. A model built in here
    also merges its projections without copying (`merge_linears`): copying memory that holds nothing
    yet touched every page twice, 0.7 s of SmolLM2's next 1.1 s."""
    global _uninitialised
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters, _uninitialised
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    _uninitialised = True
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters, _uninitialised = saved


def merge_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the linears' weights (and biases) into one matrix, and make each linear's own parameters
    row slices of it: one matmul then computes all their outputs side by side.

        merged weight [sum of out_features, in_features]
            rows [0, n0)            linears[0].weight   (a view: same memory)
            rows [n0, n0 + n1)      linears[1].weight
            ...

    The parameters keep their names, so state_dict() and load_state_dict() (which copies into the
    views) see nothing new. A move to another device or dtype gives each parameter its own memory
    again: merge again after it (LlamaForCausalLM does, in `_apply`, where `still_merged` says)."""
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("merge_linears needs a bias on every linear or on none")
    # built inside uninitialised_weights(), the linears hold nothing yet: the checkpoint is loaded into the
    # merged matrix through the views below, so there is nothing to copy
    stack = _empty_stack if _uninitialised else torch.cat
    with torch.no_grad():
        weight = stack([lin.weight.detach() for lin in linears])
        bias = stack([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=lin.bias.requires_grad)
        start += lin.out_features
    return weight, bias


def _empty_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat's result, shape, dtype and device, without its values."""
    first = tensors[0]
    return first.new_empty((sum(t.shape[0] for t in tensors), *first.shape[1:]))


def still_merged(merged: torch.Tensor | None, *linears: nn.Linear) -> bool:
    """True when every linear's weight still lies in `merged`'s memory (not moved since `merge_linears`).
    Merging again then would only move the weights under a CUDA graph that recorded their addresses."""
    return merged is not None and all(
        lin.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr() for lin in linears)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata, backend) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, meta, self.scale)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(T, -1))

    def merge_projections(self) -> None:
        """q, k and v projections as one matmul (qkv_weight [(H + 2 KV) * head_dim, hidden]; Qwen2's biases too)."""
        if not still_merged(getattr(self, "qkv_weight", None), self.q_proj, self.k_proj, self.v_proj):
            self.qkv_weight, self.qkv_bias = merge_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward_fused(self, x, positions, inv_freq, meta: AttentionMetadata, backend) -> torch.Tensor:
        from minikv.kernels import rotary_qkv

        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + 2 KV) * head_dim]
        q, k, v = rotary_qkv(qkv, positions, inv_freq, self.num_heads, self.num_kv_heads)
        out = backend.forward(self.layer_idx, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU

    def merge_projections(self) -> None:
        """gate and up projections as one matmul (gate_up_weight [2 * intermediate, hidden])."""
        if not still_merged(getattr(self, "gate_up_weight", None), self.gate_proj, self.up_proj):
            self.gate_up_weight, _ = merge_linears(self.gate_proj, self.up_proj)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        from minikv.kernels import silu_and_mul

        return self.down_proj(silu_and_mul(F.linear(x, self.gate_up_weight)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, residual, positions, inv_freq, meta, backend):
        """The same layer with the residual add left to the next norm (vLLM's layout): takes the previous
        layer's output and the residual stream before it (None in the first layer: x is the stream),
        returns this layer's output and the stream before it. The sum of the two is `forward`'s x."""
        from minikv.kernels import fused_add_rms_norm

        h, residual = fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn.forward_fused(h, positions, inv_freq, meta, backend)
        h, residual = fused_add_rms_norm(h, residual, self.post_attention_layernorm.weight,
                                         self.post_attention_layernorm.eps)
        return self.mlp.forward_fused(h), residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / SmolLM decoder. `forward` returns logits of the selected tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # kept in fp32 and out of the state dict: model.to(bfloat16) must not round the frequencies
        self._inv_freq = rope_inv_freq(cfg)
        # one switch between the two forwards (the engine sets it: LLM(fused_ops=...)). The merged weights
        # exist either way: flipping the switch moves no memory, so CUDA graphs recorded before stay valid.
        self.fused_ops = False
        self._merge_projections()

    def _merge_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()

    def _apply(self, fn, recurse: bool = True):
        """.to(), .half(), .cuda() ... give every moved parameter its own memory: merge those projections again."""
        super()._apply(fn, recurse)
        self._merge_projections()
        return self

    def __setstate__(self, state) -> None:
        """copy.deepcopy and unpickling copy each parameter on its own: merge the copies again."""
        super().__setstate__(state)
        self._merge_projections()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend,
        logits_indices: torch.Tensor | None = None,  # [B] which tokens need logits; None = all
        logits_out: torch.Tensor | None = None,  # float32 [B, vocab]: the logits go here (a graph's static buffer)
    ) -> torch.Tensor:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        if self.fused_ops:
            return self._forward_fused(input_ids, positions, meta, backend, logits_indices, logits_out)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, backend)
        if logits_indices is not None:
            x = x[logits_indices]
        return self._logits(self.model.norm(x), logits_out)

    def _logits(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The LM head's float32 logits, into `out` when given. On a GPU with 16-bit weights the GEMM writes
        float32 itself (`torch.mm`'s out_dtype: cuBLAS accumulates in float32 anyway), so the logits skip the
        rounding to 16 bits and the cast kernel: on an H200 that cast read and wrote ~200 MB in 0.1 ms of a
        218-sequence decode step's 2 ms of device time. Elsewhere (and before torch 2.8, which has no
        out_dtype): the LM head in the model's dtype, then float32; into `out`, the cast and the copy are one
        kernel."""
        w = self.lm_head.weight
        sixteen_bit = x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
        if x.is_cuda and sixteen_bit and self.lm_head.bias is None and x.dim() == 2 and MM_OUT_DTYPE:
            return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        logits = self.lm_head(x)
        if out is None:
            return logits.float()
        out.copy_(logits)
        return out

    def _forward_fused(self, input_ids, positions, meta, backend, logits_indices, logits_out=None) -> torch.Tensor:
        """`forward` through the fused kernels: the residual stream travels beside each layer's output
        and is added in the next layer's first norm (or the final norm)."""
        from minikv.kernels import fused_add_rms_norm

        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer.forward_fused(x, residual, positions, self._inv_freq, meta, backend)
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = fused_add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)
        return self._logits(x, logits_out)
