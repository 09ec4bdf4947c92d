"""What a prompt may be, checked before it reaches the engine.

    "The KV cache is"                            text (the model needs a tokenizer)
    [791, 85, 9], (791, 85, 9), tensor([791, 85, 9])      token ids: ints in [0, vocab_size)
    {"prompt": "The KV cache is", "cache_salt": "alice"}  text or ids ("prompt_token_ids") in a dict,
    {"prompt_token_ids": [791, 85, 9]}                    with an optional cache salt (tenant)

Anything else is a ValueError naming what was given and what to pass instead: a float id is never
truncated (1.7 is not token 1), a string of digits is not a list of ids, True is not token 1.
"""
from __future__ import annotations

import sys
from array import array
from numbers import Integral, Number
from typing import Any

import numpy as np

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def validate_cache_salt(salt: Any) -> str | None:
    """A cache salt names a tenant: requests with different salts never share cached blocks.
    Only strings (or None) are salts: 1 and True, or 5 and 5.0, would otherwise be one tenant."""
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string or None, got {salt!r} ({type(salt).__name__}); "
                         f"use str(...) of it to name the tenant")
    return salt


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt (text, a dict, or one sequence of ids), False for a list of prompts."""
    if isinstance(prompts, (str, dict, tuple)) or _is_array(prompts):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], Number)  # [1.7]: one bad prompt


def _is_array(x: Any) -> bool:
    return hasattr(x, "tolist") and hasattr(x, "ndim")  # a torch tensor or a numpy array


def token_ids(ids: Any, name: str = "prompt_token_ids") -> list[int]:
    """A list, tuple or 1-D integer tensor/array of token ids -> a list of Python ints."""
    if _is_array(ids):
        if ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D (one prompt), got a tensor of shape {tuple(ids.shape)}; "
                             "pass a list of prompts for a batch")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        hint = " (pass text as a string prompt, or {'prompt': ...})" if isinstance(ids, str) else ""
        raise ValueError(f"{name} must be a list of token ids (ints), got {type(ids).__name__} {ids!r}{hint}")
    if set(map(type, ids)) <= {int}:  # the common case, checked at C speed: plain Python ints
        return list(ids)
    for i, t in enumerate(ids):  # numpy or torch scalars, or a mistake to name
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise ValueError(f"{name}[{i}] is {t!r} ({type(t).__name__}); token ids are integers")
    return [int(t) for t in ids]


def parse_prompt(prompt: Any, tokenizer, vocab_size: int, check_range: bool = True
                 ) -> tuple[list[int], str | None, str | None]:
    """One prompt -> (token ids, its text or None, cache salt or None), every id in [0, vocab_size).
    check_range=False leaves that range (and an empty prompt) to the caller: the engine core checks it
    at its border anyway (EngineCore.new_sequence), and an 8k-token prompt's min and max cost ~0.1 ms."""
    salt = None
    if isinstance(prompt, dict):
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"a dict prompt needs exactly one of 'prompt' (text) or 'prompt_token_ids' (ids), "
                             f"and may have 'cache_salt'; got keys {list(prompt)}")
        salt = validate_cache_salt(prompt.get("cache_salt"))
        if "prompt_token_ids" in prompt:
            prompt = token_ids(prompt["prompt_token_ids"])
        else:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"'prompt' must be text, got {type(prompt).__name__} {prompt!r}; "
                                 "pass token ids as 'prompt_token_ids'")
    text = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer; pass prompts as lists of token ids")
        text = prompt
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, (list, tuple)) or _is_array(prompt):
        ids = token_ids(prompt, "prompt")
    else:
        hint = "; wrap one token id in a list: [id]" if isinstance(prompt, Integral) else ""
        raise ValueError(f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__} "
                         f"{prompt!r}{hint}")
    if check_range:
        check_token_range(ids, vocab_size)
    return ids, text, salt


def check_token_range(ids: list[int], vocab_size: int) -> bytes | None:
    """At least one id, and every id in [0, vocab_size): a ValueError naming the first that is not.

    Returns the ids as 8 little-endian bytes each (`id_bytes`' form, what the hash chain's keys hash),
    made by the same C pass that checked them; None where that pass could not take them (then nothing
    is saved, and the prefix cache converts them itself)."""
    if not ids:
        raise ValueError("prompt is empty; give at least one token")
    try:  # the common case in one C pass: unsigned 64-bit ints (a negative or non-integer id raises), their max
        packed = array("Q", ids)
        if int(np.frombuffer(packed, dtype=np.uint64).max()) < vocab_size:
            if sys.byteorder == "big":
                packed.byteswap()
            return packed.tobytes()
    except (TypeError, OverflowError, ValueError):
        pass
    if min(ids) < 0 or max(ids) >= vocab_size:  # (two C loops, not one Python comparison per token)
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}); "
                         "use ids from this model's tokenizer")
    return None
