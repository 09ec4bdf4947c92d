"""A block is stored under a key that must make a wrong hit impossible:

    store key = sha256(identity, block hash)
    block hash  the hash chain's key: every token of the prefix up to this block, and the cache salt
    identity    the model (a fingerprint of every weight, its dtype) and the pool's storage format
                (block size, layout, each pool tensor's dtype and shape per block)

Another model, another kv dtype, another block size or another tenant computes other keys, so it
never hits. The weights' fingerprint follows the weights: `weights_fingerprint` hashes every byte
again whenever a tensor's storage, version counter or sampled bytes moved (an in-place change), so
an engine built or derived after a change gets a new identity.
"""
from __future__ import annotations

import hashlib
import json
import weakref
from typing import Iterable

import torch

FORMAT = "minikv-kv-1"  # bump when the file layout or the key's recipe changes
FINGERPRINT_SAMPLES = 256  # elements of each tensor whose bytes stamp the weights between full hashes


def fingerprint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: the weights' identity."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")  # the buffer, no copy
    return h.hexdigest()


def weights_stamp(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A cheap stamp that moves whenever a weight may have changed: each tensor's storage address,
    version counter (bumped by every in-place op, under no_grad too), dtype, shape, and the bytes of
    FINGERPRINT_SAMPLES evenly spaced elements (a write through `.data` bypasses the counter)."""
    h = hashlib.sha256()
    samples: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype) -> each tensor's sample, in order
    for name, t in named:
        t = t.detach()
        version = -1 if t.is_inference() else t._version  # inference tensors keep no counter: the sample decides
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{t.data_ptr()}|{version}|".encode())
        if t.numel():
            flat = t.reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            samples.setdefault((str(t.device), t.dtype), []).extend([flat[::step], flat[-1:]])
    # one copy to the host per device and dtype, not one per tensor: on a GPU each copy waits for the
    # work queued before it, and a model has hundreds of tensors
    for parts in samples.values():  # in the order the groups first appeared: the same for the same weights
        h.update(torch.cat(parts).to("cpu").contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (stamp, sha256)


def weights_fingerprint(model: torch.nn.Module, fresh: bool = False) -> str:
    """`fingerprint_tensors` of the model's weights, hashed again only when `weights_stamp` moved (or
    `fresh`): an engine derived after an in-place change never takes the old weights' identity, while
    engines derived from unchanged weights skip hashing every byte again (a real model's weights are
    hundreds of MB). A change no stamp sees (one element written through `.data` outside the sample)
    needs `reset_prefix_cache()`, which hashes every byte again."""
    stamp = weights_stamp(model.state_dict().items())
    known = _FINGERPRINTS.get(model)
    if fresh or known is None or known[0] != stamp:
        known = (stamp, fingerprint_tensors(model.state_dict().items()))
        _FINGERPRINTS[model] = known
    return known[1]


def pool_format(pool) -> dict:
    """The pool's storage format, read from its tensors: whatever a pool keeps per block (K, V, and
    any scales a quantized pool adds) enters with its dtype and per-block shape."""
    tensors = sorted((name, str(t.dtype), [t.shape[0]] + list(t.shape[2:]))
                     for name, t in vars(pool).items() if isinstance(t, torch.Tensor))
    return {"block_size": pool.block_size, "layout": getattr(pool, "kv_layout", None), "tensors": tensors}


def store_identity(weights: str, model_dtype: torch.dtype, pool) -> str:
    """Hex digest of everything besides the tokens that decides a block's bytes."""
    text = json.dumps({"format": FORMAT, "weights": weights, "dtype": str(model_dtype), "pool": pool_format(pool)},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def store_key(identity: str, block_hash: bytes) -> bytes:
    return hashlib.sha256(bytes.fromhex(identity) + block_hash).digest()
