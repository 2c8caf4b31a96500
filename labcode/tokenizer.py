"""The course's two tokenizers: characters for the tiny model, byte-level BPE for the real one.

Introduced in chapter 1. `CharTokenizer` has a fixed 64-symbol alphabet: every character of the
generated corpus is in it, so encoding the corpus never fails; anything else raises.
`BPETokenizer` is SmolLM2's byte-level BPE, built from the tokens and merges its GGUF file holds.
"""

from __future__ import annotations

import string

import torch

from labcode.checks import fail

ALPHABET = "\n !'(),-.:;?" + string.ascii_uppercase + string.ascii_lowercase
assert len(ALPHABET) == 64, len(ALPHABET)


class Tokenizer:
    """What every tokenizer of the course shares: ids as the [1, T] tensor the model takes, and the check
    that ids to decode are in the vocabulary. Subclasses give `vocab_size`, `encode` and `decode`."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_tensor(self, text: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Text to a [1, T] LongTensor, the shape the model takes."""
        return torch.tensor([self.encode(text)], dtype=torch.long, device=device)

    def ids_in_vocabulary(self, ids) -> list[int]:
        """A sequence (or 1-D tensor) of ids as a list; ValueError naming the first id outside the
        vocabulary (a negative one would otherwise index from the end and decode silently)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            fail("ids", f"values in [0, {self.vocab_size})", repr(bad[0]))
        return list(ids)


class CharTokenizer(Tokenizer):
    """Maps each character of `ALPHABET` to its index, and back."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet
        self.stoi = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Text to a list of ids; raises ValueError naming the first unknown character."""
        bad = [ch for ch in text if ch not in self.stoi]
        if bad:
            fail("text", "characters of the alphabet only", repr(bad[0]))
        return [self.stoi[ch] for ch in text]

    def decode(self, ids) -> str:
        """A sequence (or 1-D tensor) of ids to text."""
        return "".join(self.alphabet[i] for i in self.ids_in_vocabulary(ids))


# 3 is llama.cpp's CONTROL token type: <|im_start|> and the like, matched whole, never split.
CONTROL = 3


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2's scheme) as SmolLM2 uses it, on the `tokenizers` library, with its chat template.

    Text is split first into single digits (llama.cpp's `smollm` pre-tokenizer), then by GPT-2's
    pattern into words, each word's UTF-8 bytes are spelled in GPT-2's byte alphabet, and the merges
    join neighbours in rank order. Control tokens such as <|im_start|> are matched whole."""

    def __init__(self, tokenizer, chat_template: str, bos_id: int, eos_id: int) -> None:
        self.tokenizer, self.chat_template, self.bos_id, self.eos_id = tokenizer, chat_template, bos_id, eos_id

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> BPETokenizer:
        """From a GGUF file's `tokenizer.*` metadata (model `gpt2`, pre-tokenizer `smollm`)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        for key, want in (("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "smollm")):
            if meta.get(key) != want:
                fail(key, repr(want), repr(meta.get(key)))
        needed = ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id")
        missing = [f"tokenizer.ggml.{k}" for k in needed if f"tokenizer.ggml.{k}" not in meta]
        if missing or "tokenizer.chat_template" not in meta:
            fail(missing[0] if missing else "tokenizer.chat_template", "a value", "none")
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
        return cls(tok, meta["tokenizer.chat_template"], int(meta["tokenizer.ggml.bos_token_id"]),
                   int(meta["tokenizer.ggml.eos_token_id"]))

    def to_payload(self) -> dict:
        return {"json": self.tokenizer.to_str(), "chat_template": self.chat_template,
                "bos_id": self.bos_id, "eos_id": self.eos_id}

    @classmethod
    def from_payload(cls, payload: dict) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(payload["json"]), payload["chat_template"], payload["bos_id"],
                   payload["eos_id"])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Text to a list of ids; control tokens written in the text become their one id. No BOS is added
        (the model's file says not to)."""
        if not isinstance(text, str):
            fail("text", "a str", type(text).__name__)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """A sequence (or 1-D tensor) of ids to text, control tokens included."""
        return self.tokenizer.decode(self.ids_in_vocabulary(ids), skip_special_tokens=False)

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, by the model's chat template (ChatML)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                     for m in messages):
            fail("messages", "a list of {'role': ..., 'content': ...} dicts", repr(messages)[:80])
        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
            self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)
