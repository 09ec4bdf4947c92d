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
beams and preemption need nothing extra. Each step decodes the whole output again, as the tokenizer
would at the end; this keeps the text equal to `tokenizer.decode(output ids)` for any tokenizer
whose decoding of a prefix is a prefix of the full decoding (byte-level BPE, SentencePiece).
"""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


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


def detokenize(tokenizer, output_token_ids: list[int], sent: str, stop: list[str], finished: bool) -> TextUpdate:
    """The next delta of a sequence that has streamed `sent` so far.

    finished: the sequence ends with this token for another reason (EOS, length): send everything.
    A stop string match ends it too (`stopped`); the caller sets the finish reason.
    """
    text = tokenizer.decode(output_token_ids, skip_special_tokens=True)
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
