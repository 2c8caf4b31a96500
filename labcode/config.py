"""The model configuration: one frozen dataclass and its named presets.

Introduced in chapter 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labcode.checks import fail, is_int


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-architecture model. Every field is fixed after creation."""

    vocab_size: int = 64  # V: number of token ids
    context_length: int = 64  # rows of the learned position table: a hard limit on positions
    n_layers: int = 2  # L: transformer blocks
    n_heads: int = 4  # H: query heads per layer
    n_kv_heads: int | None = None  # Hkv: key/value heads (None means H; fewer means grouped-query)
    d_model: int = 64  # C: model width; head dim D = C // H
    rotary: bool = False  # rotary positions on Q and K instead of the learned position table
    rope_base: float = 10000.0  # base of the rotary frequencies (used only when rotary)
    dropout: float = 0.0  # dropout on attention weights and residuals, active only in train()
    sliding_window: int | None = None  # W: each query sees its last W keys, itself included (None: every earlier key)

    def __post_init__(self) -> None:
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        object.__setattr__(self, "n_kv_heads", kv)
        checks = {  # field: (valid, what was expected)
            "vocab_size": (self.vocab_size > 0, "a positive number of token ids"),
            "context_length": (self.context_length > 0, "a positive number of positions"),
            "n_layers": (self.n_layers > 0, "a positive number of layers"),
            "d_model": (self.d_model > 0, "a positive model width"),
            "n_heads": (self.n_heads > 0 and self.d_model % self.n_heads == 0,
                        f"a positive divisor of d_model {self.d_model}"),
            "n_kv_heads": (kv > 0 and self.n_heads > 0 and self.n_heads % kv == 0,
                           f"a positive divisor of n_heads {self.n_heads}"),
            "rope_base": (self.rope_base > 0, "a positive base"),
            "dropout": (0.0 <= self.dropout < 1.0, "0 <= dropout < 1"),
            "sliding_window": (self.sliding_window is None or (is_int(self.sliding_window) and self.sliding_window > 0),
                               "None or a positive int (the keys each query sees, itself included)"),
        }
        for name, (ok, expected) in checks.items():
            if not ok:
                fail(f"GPTConfig.{name}", expected, repr(getattr(self, name)))
        if self.rotary and self.head_dim % 2:
            fail("GPTConfig.d_model", "an even head dim (rotary positions turn pairs of channels)",
                 f"head dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """D, the width of one attention head."""
        return self.d_model // self.n_heads

    def with_(self, **changes) -> GPTConfig:
        """A copy with some fields changed (the config itself is frozen)."""
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None  # plain multi-head attention stays plain with the new head count
        return replace(self, **changes)


PRESETS: dict[str, GPTConfig] = {
    # The seed's worked example: L=2, C=16, used for the 768-element cache-size count.
    "micro": GPTConfig(vocab_size=64, context_length=16, n_layers=2, n_heads=2, d_model=16),
    # The trained model every chapter uses; fast on two CPU cores.
    "tiny": GPTConfig(vocab_size=64, context_length=64, n_layers=2, n_heads=4, d_model=64),
    # A mid-size random-weight model for benchmarks.
    "small": GPTConfig(vocab_size=50257, context_length=1024, n_layers=6, n_heads=6, d_model=384),
    # GPT-2 124M shapes, random weights, for benchmarks only.
    "gpt2-124m": GPTConfig(vocab_size=50257, context_length=1024, n_layers=12, n_heads=12, d_model=768),
}


def get_config(name: str, **changes) -> GPTConfig:
    """Return the preset called `name`, with optional field changes."""
    if name not in PRESETS:
        fail("preset", f"one of {sorted(PRESETS)}", repr(name), KeyError)
    return PRESETS[name].with_(**changes) if changes else PRESETS[name]
