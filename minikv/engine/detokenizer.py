"""Token ids -> streamed text, one token at a time, with stop strings that may span tokens.

A stream must only ever send text that stays in the final output: every delta is final, the
deltas joined ARE the output text. Two things in the newest text may still change, so they are
held back until the next token settles them:

    stop = ["vast."], decoded output "The sea is a vas"
    [0, sent)       "The sea is a"   already streamed (seq.text)
    [sent, hold)    " "              streamed now: the delta
    [hold, end)     "vas"            held back: it could still begin "vast."
                                     (so is a half-decoded multi-byte character, decoded as "\ufffd")

When a stop string appears the text is cut where it begins and nothing after it is ever sent.
When the sequence finishes for another reason (EOS, length) everything held back is sent. An aborted
sequence keeps what was streamed; `flush` gives what was held back, for a last delta.

The state is the sequence's own (its output token ids and the text already streamed), so forks,
beams and preemption need nothing extra. Decoding the whole output again at every step would cost
O(n) per token, O(n^2) per request (540 us per step for a 512-token output of SmolLM2's tokenizer, for
each running request). A `DecodeState` (the engine keeps one per plain sequence) decodes only a small
window instead, as vLLM's and TGI's incremental detokenizers do:

    ids          [ .............. settled .............. | p .. r | r .. new ]
    state.text   decode(ids[:r]), grown window by window
    each token   new text = decode(ids[p:])[len(decode(ids[p:r])):]    (a few tokens each)

The window's first tokens [p, r) give the decoder the context a lone token lacks (SentencePiece drops
a leading space at the start of a decode). While the newest text ends in a half-decoded character the
window just grows; once it is whole, the offsets move on. This keeps the text equal to
`tokenizer.decode(output ids)` for any tokenizer whose decoding of a prefix is a prefix of the full
decoding (byte-level BPE, SentencePiece); the tests check it on the course's model.

Where the text is made. In one process the core detokenizes as it appends each token. Behind the
server (minikv/serve/core_process.py) the core sends token ids only and the server's process makes
each sample's text with a `TextStream` (the same code), as vLLM's front end does: the core's
interpreter spends its time on steps, not on strings. One rule keeps the output exactly the
in-process one: a request whose text decides when it ends (stop strings; beams, ranked on whole
texts) keeps its text in the core (`text_in_core`). A stop string found one process away would
come steps late: the core would have run, counted and cached tokens past it, and stopping one
sample of n > 1 would need an abort per sample; found in the core, the sequence ends on the token
that completes it, as in `generate`.
"""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


@dataclass
class DecodeState:
    """Where a sequence's incremental decoding stands (see the top): text = decode(ids[:read_offset])."""

    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    window: tuple = ()  # ids[prefix_offset:read_offset] when the text was last extended (a check)


def decoded_text(tokenizer, ids: list[int], state: DecodeState) -> str:
    """tokenizer.decode(ids, skip_special_tokens=True), from a few tokens' decoding on top of `state`."""
    p, r = state.prefix_offset, state.read_offset
    if r > len(ids) or tuple(ids[p:r]) != state.window:  # new, or its ids changed under it: start again
        r = max(len(ids) - 1, 0)
        p = max(r - 4, 0)
        state.prefix_offset, state.read_offset, state.window = p, r, tuple(ids[p:r])
        state.text = tokenizer.decode(ids[:r], skip_special_tokens=True)  # once: O(n)
    before = tokenizer.decode(ids[p:r], skip_special_tokens=True) if r > p else ""
    after = tokenizer.decode(ids[p:], skip_special_tokens=True)
    if not after.startswith(before):  # a tokenizer that rewrites its window's start: decode all of it
        state.read_offset = len(ids) + 1  # (and start again next time)
        return tokenizer.decode(ids, skip_special_tokens=True)
    new = after[len(before):]
    if new and not new.endswith(REPLACEMENT):  # whole characters: settle them, move the window on
        state.text += new
        state.prefix_offset, state.read_offset, state.window = r, len(ids), tuple(ids[r:])
        return state.text
    return state.text + new  # a character still missing bytes: the window grows until it is whole


@dataclass
class TextUpdate:
    delta: str  # new text, safe to stream (never taken back)
    stopped: bool  # a stop string matched: the text ends where it began


def find_stop(text: str, stop: list[str]) -> int:
    """Index where the first stop string in `text` begins, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (may still become one).

        text "a vas", stop ["vast."]  -> 3   ("vas")
        text "a va",  stop ["st", "a b"] -> 1 ("a"; "s" does not end the text)
    """
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def detokenize(tokenizer, output_token_ids: list[int], sent: str, stop: list[str], finished: bool,
               state: DecodeState | None = None) -> TextUpdate:
    """The next delta of a sequence that has streamed `sent` so far.

    finished: the sequence ends with this token for another reason (EOS, length): send everything.
    A stop string match ends it too (`stopped`); the caller sets the finish reason.
    state: the sequence's DecodeState (a few tokens decoded per call); None decodes the whole output.
    """
    if state is None:
        text = tokenizer.decode(output_token_ids, skip_special_tokens=True)
    else:
        text = decoded_text(tokenizer, output_token_ids, state)
    cut = find_stop(text, stop)
    if cut >= 0:
        text = text[:cut]
    elif not finished:
        text = text.rstrip(REPLACEMENT)  # a multi-byte character whose bytes are not all here yet
        text = text[:len(text) - stop_prefix_len(text, stop)]
    # [0, len(sent)) was streamed already: a prefix-stable tokenizer decodes it to the same characters
    # (one that rewrites earlier text keeps what it sent and goes on from the same length)
    delta = text[len(sent):]
    return TextUpdate(delta, cut >= 0)


def flush(tokenizer, output_token_ids: list[int], sent: str, stop: list[str]) -> str:
    """What is still held back, for a sequence that ends now (an abort): the last delta to send."""
    if tokenizer is None:
        return ""
    return detokenize(tokenizer, output_token_ids, sent, stop, finished=True).delta


def text_in_core(params, beam: bool = False) -> bool:
    """Whether a request's text must be made where its tokens are, in the core (see the top): its stop
    strings end it, or it is a beam (beams rewrite their outputs)."""
    return bool(params.stop) or beam


class TextStream:
    """One sample's text, made from its token ids as they arrive, away from the core (the server's
    process, for requests without stop strings: `text_in_core`). The deltas join to exactly what the
    core would have made: `add` is `EngineCore.append_token`'s detokenizing, and an abort's flush."""

    def __init__(self, tokenizer):
        """tokenizer: the model's, or `fast_decoder(tokenizer)` (made once, shared by every stream)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # streamed so far
        self.state = DecodeState()

    def add(self, token_id: int | None, finish_reason: str | None) -> str:
        """The text delta of one event of this sample: a new token (finish_reason set when it is the
        last), or an end without a token ("abort": what was held back goes out; "error": nothing)."""
        if token_id is not None:
            self.ids.append(token_id)
            delta = detokenize(self.tokenizer, self.ids, self.text, [], finish_reason is not None, self.state).delta
        elif finish_reason == "abort":
            delta = flush(self.tokenizer, self.ids, self.text, [])
        else:
            return ""
        self.text += delta
        return delta


class _BackendDecode:
    """`tokenizer.decode(ids, skip_special_tokens=...)` read straight from a fast tokenizer's own (Rust)
    decoder: the Python wrapper's per-call conversions cost as much as decoding a few tokens."""

    def __init__(self, backend):
        self.backend = backend

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer):
    """What a `TextStream` decodes with: the tokenizer's backend when its wrapper adds nothing (no
    clean-up of spaces, the same text on a probe of ids), else the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    probe = list(range(min(len(tokenizer), 1024)))
    try:
        same = all(backend.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
                   for ids in (probe, probe[::-1], probe[1::7]))
    except Exception:  # noqa: BLE001  a tokenizer this cannot read: the plain way
        return tokenizer
    return _BackendDecode(backend) if same else tokenizer
