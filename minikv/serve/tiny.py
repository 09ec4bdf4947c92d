"""`tiny-random` with a byte-level tokenizer and a chat template: a text model that loads in a moment,
so tests and notebooks can drive the text and chat routes of the server without loading SmolLM2.

    ids 0, 1, 2       <unk>, <s>, </s> (tiny-random's bos and eos)
    ids 3 .. 258      the 256 bytes (GPT-2's byte-to-character map); ids 259 .. 511 decode to nothing

Its words are random, of course: what it shows is the plumbing (tokens in, text out, token for token
the same as the in-process engine), not language.
"""
from __future__ import annotations

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """A transformers tokenizer over bytes (259 ids), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_random_with_text(device: str = "cpu"):
    """The loaded `tiny-random` model with `byte_tokenizer()`: pass it to LLM(...) as the model."""
    import dataclasses

    import torch

    from minikv.model.loader import load_model

    loaded = load_model("tiny-random", torch.device(device), torch.float32)
    return dataclasses.replace(loaded, tokenizer=byte_tokenizer(), source="tiny-random")
