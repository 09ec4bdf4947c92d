"""Streamed text: the deltas always join to the final text, nothing later cut is ever sent, and a
stop string is found even when it spans a token boundary (issue 11, item 4)."""
import json
import random

import pytest
from safetensors.torch import save_file

from minikv import LLM, SamplingParams
from minikv.engine.detokenizer import (
    REPLACEMENT,
    DecodeState,
    TextStream,
    detokenize,
    fast_decoder,
    find_stop,
    flush,
    stop_prefix_len,
)
from minikv.model.config import ModelConfig
from minikv.model.llama import LlamaForCausalLM
from minikv.model.loader import tiny_random_weights
from minikv.model.named import TINY_RANDOM_CONFIG


class ByteTokenizer:
    """A fake tokenizer: each id is a few bytes; id 0 is a special EOS that decodes to nothing."""

    PIECES = [b"", b"The", b" sea", b" is", b" a", b" va", b"st", b",", b" vast", b"s", b"t", b"a", b" ",
              "🌊".encode()[:2], "🌊".encode()[2:], "é".encode()[:1], "é".encode()[1:], "海".encode()[:1],
              "海".encode()[1:], b"!"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0)).decode("utf-8", "replace")


def run(tokenizer, ids, stop, finish_at_end=True, incremental=False):
    """Feed ids one at a time as the engine does; returns (deltas, final text, stopped). incremental: with a
    DecodeState (a few tokens decoded per call), as the engine's plain sequences are."""
    sent, deltas = "", []
    state = DecodeState() if incremental else None
    for i in range(len(ids)):
        update = detokenize(tokenizer, ids[: i + 1], sent, stop, finished=finish_at_end and i == len(ids) - 1,
                            state=state)
        deltas.append(update.delta)
        sent += update.delta
        if update.stopped:
            return deltas, sent, True
    return deltas, sent, False


def reference(tokenizer, ids, stop):
    """The spec: the text of the shortest run of tokens that holds a stop string, cut where the first one
    begins; with no stop string, the whole decoded output."""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i])
        if find_stop(text, stop) >= 0:
            return text[: find_stop(text, stop)], True
    return tokenizer.decode(ids), False


def test_stop_string_spanning_two_tokens_is_never_streamed():
    tok = ByteTokenizer()
    ids = [1, 2, 3, 4, 8, 7, 19]  # "The sea is a vast,!"
    deltas, text, stopped = run(tok, ids, ["st,"])
    assert stopped and text == "The sea is a va" and "".join(deltas) == text
    # the "s" of " is" and the "st" of " vast" could begin "st,": each waits for the next token
    assert deltas == ["The", " sea", " i", "s a", " va", ""]


def test_held_back_characters_go_out_once_they_cannot_begin_a_stop_string():
    tok = ByteTokenizer()
    deltas, text, stopped = run(tok, [1, 5, 10, 19], ["vast"], finish_at_end=False)  # "The" " va" "t" "!"
    assert not stopped
    assert deltas == ["The", " ", "vat", "!"]  # "va" waits (could begin "vast"); "vat" cannot


def test_first_stop_string_to_complete_wins_and_the_text_is_cut_where_it_begins():
    tok = ByteTokenizer()
    deltas, text, stopped = run(tok, [1, 2, 3, 4], [" is", "sea"])
    assert stopped and text == "The " and "".join(deltas) == text


def test_half_a_multibyte_character_is_held_back_then_sent_whole():
    tok = ByteTokenizer()
    deltas, text, _ = run(tok, [1, 13, 14, 15, 16, 17, 18], [], finish_at_end=False)
    assert deltas == ["The", "", "🌊", "", "é", "", "海"]
    assert REPLACEMENT not in "".join(deltas)


@pytest.mark.parametrize("why", ["eos", "length"])
def test_a_sequence_finishing_for_another_reason_flushes_what_was_held_back(why):
    tok = ByteTokenizer()
    ids = [1, 5] + ([0] if why == "eos" else [])  # "The va" (+ EOS): " va" could begin "vast"
    deltas, text, stopped = run(tok, ids, ["vast"])
    assert not stopped and text == "The va" and "".join(deltas) == text
    deltas, text, _ = run(tok, [1, 13], [])  # half an emoji at the end: sent as the tokenizer decodes it
    assert text == tok.decode([1, 13]) == "The" + REPLACEMENT


def test_flush_gives_the_held_back_text_of_an_aborted_sequence():
    tok = ByteTokenizer()
    deltas, sent, _ = run(tok, [1, 5], ["vast"], finish_at_end=False)
    assert sent == "The "
    assert flush(tok, [1, 5], sent, ["vast"]) == "va"
    assert flush(None, [1, 5], sent, ["vast"]) == ""


def test_stop_prefix_len():
    assert stop_prefix_len("a vas", ["vast."]) == 3
    assert stop_prefix_len("a va", ["st", "a b"]) == 1
    assert stop_prefix_len("abc", []) == 0
    assert stop_prefix_len("ab", ["abcd"]) == 2


def test_random_streams_join_to_the_reference_text():
    tok, rng = ByteTokenizer(), random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(len(tok.PIECES)) for _ in range(rng.randint(1, 14))]
        full = tok.decode(ids)
        stop = [full[i:i + rng.randint(1, 5)] for i in (rng.randrange(len(full) + 1) for _ in range(rng.randint(0, 2)))]
        stop = [s for s in stop if s] + rng.sample(["vast", "st,", "a s", "🌊"], rng.randint(0, 2))
        for incremental in (False, True):
            deltas, text, stopped = run(tok, ids, stop, incremental=incremental)
            assert "".join(deltas) == text
            assert (text, stopped) == reference(tok, ids, stop), (ids, stop, incremental)


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_incremental_decoding_reads_a_few_tokens_per_step_not_the_whole_output():
    rng = random.Random(1)
    ids = [rng.randrange(1, len(ByteTokenizer.PIECES)) for _ in range(400)]
    whole, windowed = CountingTokenizer(), CountingTokenizer()
    assert run(whole, ids, ["never"])[1] == run(windowed, ids, ["never"], incremental=True)[1] == whole.decode(ids)
    assert whole.decoded > 400 * 400 / 2  # O(n^2): the whole output at every step
    assert windowed.decoded < 400 * 16, windowed.decoded  # O(n): a window of a few tokens (longer mid-character)


# ---- through the engine: tiny random weights with a real (trained in code, byte-level BPE) tokenizer ----

@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """LLM on tiny-random-sized weights whose checkpoint directory carries a byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The sea is a vast and deep place; naïve sailors sail it. 海は広い 🌊 ",
              "Stop strings may span token boundaries: vast, vastly, vase, seas, sea-salt. "]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("worded")
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    cfg = dict(TINY_RANDOM_CONFIG, vocab_size=bpe.get_vocab_size())
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg))
    tiny_random_weights(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return LLM(str(path), kv_backend="paged", block_size=8, num_blocks=64)


PROMPT = [40, 41, 42, 43]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def spanning_stop(llm, ids):
    """A stop string made of the last characters of token k-1 and the first of token k (3 or 4 printable
    characters) appearing nowhere earlier: returns (stop, where it begins in the text, k)."""
    text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(1, len(ids) - 1):
        a, b = (llm.tokenizer.decode(ids[:j], skip_special_tokens=True) for j in (k, k + 1))
        stop = a[-2:] + b[len(a):len(a) + 2]
        if b.startswith(a) and len(a) >= 1 and len(b) > len(a) and len(stop) >= 3 and stop.isprintable() \
                and REPLACEMENT not in stop and text.find(stop) == len(a) - len(a[-2:]):
            return stop, text.find(stop), k
    raise AssertionError(f"no token boundary to put a stop string across in {text!r}")


def test_engine_stream_with_a_stop_string_across_tokens_joins_to_the_final_text(worded):
    full = worded.generate([PROMPT], GREEDY)[0]
    stop, at, _ = spanning_stop(worded, full.token_ids)
    params = SamplingParams(max_tokens=32, ignore_eos=True, stop=[stop])
    events = list(worded.stream([PROMPT], params))
    cut = worded.generate([PROMPT], params)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:at]
    assert "".join(e.text_delta for e in events) == cut.text  # before: the last delta resent the whole text
    assert events[-1].finished


def test_engine_parallel_samples_each_stream_their_own_text(worded):
    params = SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=7, ignore_eos=True, stop=["e", "s "])
    events = list(worded.stream([PROMPT], params))
    out = worded.generate([PROMPT], params)[0]
    for c in out.outputs:
        assert "".join(e.text_delta for e in events if e.sample_index == c.index) == c.text


def test_engine_aborted_request_text_is_what_was_streamed_then_what_was_held_back(worded):
    full = worded.generate([PROMPT], GREEDY)[0]
    stop, at, k = spanning_stop(worded, full.token_ids)
    never = stop[:2] + "\x00"  # begins like the spanning stop, never completes
    seq = worded.add_request(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True, stop=[never]))
    deltas = []
    while len(seq.output_token_ids) < k:  # up to the token whose text ends with stop[:2]
        deltas += [d for s, _, d in worded.step() if s is seq]
        assert seq.text == "".join(deltas)
    assert seq.text == full.text[:at]  # the last 2 characters could still begin `never`: held back
    worded.abort(seq)  # the request ends: what was held back is text after all, and goes out last
    assert worded.output(seq).text == full.text[:at + 2] == "".join(deltas) + stop[:2]


@pytest.mark.slow
def test_smollm2_tokenizer_streams_multibyte_text_and_a_stop_string_across_tokens(smollm2_dir):
    from minikv.model.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode("The sea is a vast, deep ocean 🌊 海は広い. Naïve sailors!", add_special_tokens=False)
    deltas, text, stopped = run(tok, ids, [], finish_at_end=False)
    assert text == tok.decode(ids) and all(REPLACEMENT not in d for d in deltas)
    assert run(tok, ids, [], finish_at_end=False, incremental=True) == (deltas, text, stopped)
    rng = random.Random(2)  # random ids (odd byte pieces, special tokens): the window joins to the whole decode
    for _ in range(20):
        rand = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert run(tok, rand, [], incremental=True)[1] == run(tok, rand, [])[1] == tok.decode(rand,
                                                                                                skip_special_tokens=True)
    assert any(d == "" for d in deltas)  # the emoji and the kanji arrive in pieces: held back, then sent whole
    pieces = [tok.decode([t]) for t in ids]
    assert " vast" in pieces and "," in pieces  # so "st," spans two tokens
    deltas, text, stopped = run(tok, ids, ["st,", "広い."])
    assert stopped and text == "The sea is a va" and "".join(deltas) == text
    deltas, text, stopped = run(tok, ids, ["広い."])
    assert stopped and text == "The sea is a vast, deep ocean 🌊 海は" and "".join(deltas) == text


@pytest.mark.slow
def test_smollm2_tokenizer_loaded_without_autotokenizer_is_autotokenizers(smollm2_dir):
    """SmolLM2's tokenizer is the generic fast tokenizer: built straight from tokenizer.json it must
    encode, decode, apply the chat template and name its special tokens exactly as AutoTokenizer's."""
    from transformers import AutoTokenizer

    from minikv.model.loader import load_tokenizer

    ours, auto = load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    assert type(ours).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    text = "The sea is a vast, deep ocean 🌊 海は広い. Naïve sailors!  Tabs\tand\nnewlines <|im_end|> 12345"
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == auto.encode(text, add_special_tokens=add)
    ids = auto.encode(text)
    assert ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    assert len(ours) == len(auto)


def stream_text(decoder, ids: list[int], end: str | None) -> tuple[list[str], str]:
    """A TextStream fed as the server feeds it: one event per token, the last with its finish reason
    (end "abort": the abort's own event, without a token, comes after them)."""
    stream = TextStream(decoder)
    deltas = [stream.add(t, end if i == len(ids) - 1 and end != "abort" else None) for i, t in enumerate(ids)]
    if end == "abort":
        deltas.append(stream.add(None, "abort"))
    return deltas, stream.text


def test_a_text_stream_away_from_the_core_makes_the_cores_deltas():
    """The server's TextStream, fed token ids, gives the very deltas the core's append_token gives."""
    tok = ByteTokenizer()
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(len(ByteTokenizer.PIECES)) for _ in range(rng.randint(1, 12))]
        want, _, _ = run(tok, ids, [], finish_at_end=True, incremental=True)
        deltas, text = stream_text(tok, ids, "length")
        assert deltas == want and text == tok.decode(ids)
        held, _, _ = run(tok, ids, [], finish_at_end=False, incremental=True)
        deltas, text = stream_text(tok, ids, "abort")
        assert deltas[:-1] == held and text == tok.decode(ids)  # the abort sends what was held back


@pytest.mark.slow
def test_fast_decoder_decodes_as_the_smollm2_tokenizer_does(smollm2_dir):
    from minikv.model.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    fast = fast_decoder(tok)
    assert fast is not tok  # the Rust decoder straight: no wrapper on the server's engine thread
    rng = random.Random(3)  # random ids: odd byte pieces, special tokens, multi-byte characters cut in two
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        assert fast.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
        assert stream_text(fast, ids, "stop") == stream_text(tok, ids, "stop")
        assert stream_text(fast, ids, "stop")[1] == tok.decode(ids, skip_special_tokens=True)
