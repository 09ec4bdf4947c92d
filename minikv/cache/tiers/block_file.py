"""One block's file on disk: a fixed-size JSON header, then the payload.

Each file repeats the identity and the key in its header and carries a checksum of its payload: a
corrupted or truncated file is skipped (deleted, counted), never loaded. Files are written under a
temporary name and renamed, so two engines sharing a directory never read half a file.
"""
from __future__ import annotations

import hashlib
import json

import torch

from minikv.cache.tiers.store import Value

MAGIC = b"MINIKV-KV1\n"
HEADER_BYTES = 512  # the JSON header is padded to this size; the payload follows


def block_payload(value: Value) -> tuple[list, bytes]:
    """A block's tensors as (dtype and shape of each, their bytes): the only part that touches torch."""
    parts = [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in value]
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in value], b"".join(parts)


def block_file(identity: str, key: bytes, tensors: list, payload: bytes) -> bytes:
    """A block's file: a fixed-size header (identity, key, tensors, checksum) then the payload."""
    header = {"identity": identity, "key": key.hex(), "payload": len(payload), "tensors": tensors,
              "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}
    text = MAGIC + json.dumps(header).encode()
    if len(text) + 1 > HEADER_BYTES:
        raise ValueError(f"a block header of {len(text)} bytes does not fit {HEADER_BYTES}")
    return text + b" " * (HEADER_BYTES - 1 - len(text)) + b"\n" + payload


def check_block(data: bytes | bytearray, identity: str, key: bytes) -> list | None:
    """The tensors' (dtype, shape) a block file declares, if every check passes (magic, identity, key,
    sizes, checksum); None if anything is off. Bytes only: reader threads run it."""
    if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
        return None
    try:
        header = json.loads(bytes(data[len(MAGIC):HEADER_BYTES]))
        payload = memoryview(data)[HEADER_BYTES:]
        if (header["identity"], header["key"], header["payload"]) != (identity, key.hex(), len(payload)):
            return None
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            return None
        tensors = [(getattr(torch, dtype), torch.Size(shape)) for dtype, shape in header["tensors"]]
        if sum(shape.numel() * dt.itemsize for dt, shape in tensors) != len(payload):
            return None
        return tensors
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def payload_tensors(tensors: list, payload) -> Value:
    """A block's tensors as views of `payload` (a writable buffer: bytearray or memoryview of one)."""
    out, at = [], 0
    for dt, shape in tensors:
        n = shape.numel() * dt.itemsize
        out.append(torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=at).view(dt).reshape(shape))
        at += n
    return tuple(out)


def decode_block(data: bytes | bytearray, identity: str, key: bytes) -> Value | None:
    """The tensors of a block file, or None if anything is off (truncated, corrupted, another key)."""
    tensors = check_block(data, identity, key)
    if tensors is None:
        return None
    return payload_tensors(tensors, memoryview(bytearray(data))[HEADER_BYTES:])


def file_bytes(block_bytes: int) -> int:
    return HEADER_BYTES + block_bytes
