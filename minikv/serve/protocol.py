"""The OpenAI API's request fields, checked; its responses and errors, shaped.

Every bad request is an `ApiError`: an HTTP status (400, 404, 503), and the body OpenAI sends,

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

so that the `openai` client raises its own BadRequestError / NotFoundError with our message.
Accepted besides OpenAI's fields, as vLLM does: top_k, ignore_eos, priority, cache_salt,
return_token_ids, and a prompt given as token ids.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from minikv.engine.sampling_params import SamplingParams, is_int, is_real


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body as bytes, ASCII-escaped: a message quoting a client's bad text always encodes."""
        return json.dumps(self.body(), ensure_ascii=True).encode()


@dataclass
class Parsed:
    """One checked request: what to run, how to answer."""

    prompt: str | list[int] | None  # None for chat: `messages` instead
    messages: list[dict] | None
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage (so far) on every chunk
    user: str | None
    cache_salt: str | None
    return_token_ids: bool


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = {int, float, bool, type(None)}  # what JSON gives besides strings, lists and objects


# where a parsed body's strings can hold a surrogate at all: a JSON escape \ud800-\udfff, or the bytes of
# one encoded as UTF-8 (json.loads of bytes decodes them with surrogatepass)
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def may_hold_surrogate(raw: bytes) -> bool:
    """False when the body `raw` (as json.loads reads it) surely parses to no surrogate: UTF-8 without a
    surrogate's escape or bytes. One scan of the bytes in C, where `lone_surrogate` walks the parsed body
    (a prompt of a thousand token ids: a type check each)."""
    return json.detect_encoding(raw) != "utf-8" or _SURROGATE_BYTES.search(raw) is not None


def lone_surrogate(body: Any) -> str | None:
    """The path of the first string (or key) in a parsed JSON body holding a lone UTF-16 surrogate
    (JSON "\\ud83d" alone: not Unicode text, no tokenizer takes it), or None. Walks without recursion."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return path or "the body"
        elif isinstance(x, dict):
            for k, v in x.items():
                sub = f"{path}.{k}" if path else str(k)
                if _SURROGATE.search(k):
                    return sub
                stack.append((sub, v))
        elif isinstance(x, list) and not set(map(type, x)) <= _SCALARS:  # (a prompt of token ids: one C pass)
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x) if isinstance(v, (str, dict, list)))
    return None


_KINDS = {"int": (is_int, "an integer"), "number": (is_real, "a number"),  # kind -> (check, what the error asks)
          "bool": (lambda v: isinstance(v, bool), "true or false"), "str": (lambda v: isinstance(v, str), "a string"),
          "dict": (lambda v: isinstance(v, dict), "an object")}


def _field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against a kind: int, number, bool, str, dict; None (or absent) -> default."""
    value = body.get(name)
    if value is None:
        return default
    ok, want = _KINDS[kind]
    if not ok(value):
        raise ApiError(400, f"'{name}' must be {want}, got {type(value).__name__} {value!r}", param=name)
    return value


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "'prompt' is required: text, or a list of token ids", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):  # a batch of one
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "'prompt' is empty; give at least one token", param="prompt")
        return p
    if isinstance(p, list) and p and set(map(type, p)) <= {int}:  # token ids, checked at C speed
        return p
    if isinstance(p, list) and p and all(is_int(t) for t in p):  # ints of another type (a subclass)
        return [int(t) for t in p]
    if isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
        raise ApiError(400, f"'prompt' holds {len(p)} prompts; this server takes one prompt per request "
                            "(send them as concurrent requests: they are batched on the server)", param="prompt")
    raise ApiError(400, f"'prompt' must be text or a non-empty list of token ids (integers), got {p!r:.80}",
                   param="prompt")


ROLES = {"system", "user", "assistant", "developer"}
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary; beyond a C long it would fail in the sampler


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in {sorted(ROLES)}, got {m!r:.80}",
                           param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string, got {content!r:.80}",
                           param=f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"})}


def parse_request(body: Any, chat: bool, served_names: list[str], raw: bytes | None = None) -> Parsed:
    """Check one /v1/completions or /v1/chat/completions body; raise ApiError on the first problem. raw: the
    bytes it was parsed from, when at hand (they tell whether a surrogate needs looking for)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    bad = lone_surrogate(body) if raw is None or may_hold_surrogate(raw) else None
    if bad is not None:
        raise ApiError(400, f"'{bad:.80}' holds a lone UTF-16 surrogate (such as \\ud83d without its pair), which "
                            "is not Unicode text; send valid UTF-8 (both halves of a surrogate pair)",
                       param=bad[:80])
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required: a string naming a served model "
                            f"({', '.join(served_names)})", param="model")
    if model not in served_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves {', '.join(served_names)} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name)
    prompt = messages = None
    if chat:
        messages = _messages(body)
    else:
        prompt = _prompt(body)
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, max_name, "int")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'{max_name}' must be at least 1, got {max_tokens}", param=max_name)
    temperature = _field(body, "temperature", "number", 1.0)
    if not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _field(body, "top_p", "number", 1.0)
    top_k = _field(body, "top_k", "int", 0)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "no cut"
    if top_k > MAX_TOP_K:
        raise ApiError(400, f"'top_k' must be at most {MAX_TOP_K:,} (-1 or 0: no cut), got {top_k}", param="top_k")
    seed = _field(body, "seed", "int")
    n = _field(body, "n", "int", 1)
    ignore_eos = _field(body, "ignore_eos", "bool", False)
    priority = _field(body, "priority", "int", 0)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise ApiError(400, f"'stop' must be a string or a list of strings, got {stop!r:.80}", param="stop")
    stream = _field(body, "stream", "bool", False)
    options = _field(body, "stream_options", "dict", {})
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with stream: true", param="stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(name, False), bool):
            raise ApiError(400, f"'stream_options.{name}' must be true or false, got {options[name]!r:.80}",
                           param=f"stream_options.{name}")
    try:
        params = SamplingParams(max_tokens=max_tokens or 16, temperature=float(temperature), top_p=float(top_p),
                                top_k=top_k, seed=seed, n=n, ignore_eos=ignore_eos, stop=stop, priority=priority)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(" ")[0]) from None
    return Parsed(prompt, messages, params, max_tokens is not None, stream, bool(options.get("include_usage")),
                  bool(options.get("continuous_usage_stats")),
                  _field(body, "user", "str"), _field(body, "cache_salt", "str"),
                  _field(body, "return_token_ids", "bool", False))


# ---- responses ----------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(chat: bool, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
           delta: bool) -> dict:
    """One entry of `choices`: a whole answer, or (delta=True) a piece of a stream."""
    if chat:
        key = "delta" if delta else "message"
        c = {"index": index, key: {"role": "assistant", "content": text} if not delta else {"content": text},
             "logprobs": None, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def envelope(chat: bool, rid: str, model: str, created: int, choices: list[dict], stream: bool,
             usage_: dict | None = None) -> dict:
    obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None or not stream:
        out["usage"] = usage_
    return out


def now() -> int:
    return int(time.time())
