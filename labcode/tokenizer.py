"""A character-level tokenizer with a fixed 64-symbol alphabet.

Introduced in chapter 1. Every character of the generated corpus is in the
alphabet, so encoding the corpus never fails; anything else raises.
"""

from __future__ import annotations

import string

import torch

from labcode.checks import fail

ALPHABET = "\n !'(),-.:;?" + string.ascii_uppercase + string.ascii_lowercase
assert len(ALPHABET) == 64, len(ALPHABET)


class CharTokenizer:
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

    def encode_tensor(self, text: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Text to a [1, T] LongTensor, the shape the model takes."""
        return torch.tensor([self.encode(text)], dtype=torch.long, device=device)

    def decode(self, ids) -> str:
        """A sequence (or 1-D tensor) of ids to text."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < len(self.alphabet)]
        if bad:  # a negative id would otherwise index from the end and decode silently
            fail("ids", f"values in [0, {len(self.alphabet)})", repr(bad[0]))
        return "".join(self.alphabet[i] for i in ids)
