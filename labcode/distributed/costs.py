"""Shipping a cache or computing it again, on paper, at the scale of published models.

Introduced in chapter 10. A cache of T tokens holds 2 L T Hkv D elements; a link of R bit/s ships its
bytes in 8 * bytes / R seconds. Computing it again is a prefill of T tokens: 2 T P FLOPs in the
products with the P weights of the layers, 2 C V in the output head for the last token's logits (the
only ones the next token needs), plus 4 L H D T(T+1)/2 in causal attention (a prefill kernel skips the
masked half), at best at an accelerator's peak: chapter 7's roofline (`labcode.roofline.predict`)
gives the seconds. Shipping pays where it is faster than that prefill, that is on links faster than
8 * bytes / seconds(prefill): the crossover rate.

The shapes below are the published configurations (layers, heads, key/value heads, head dim, width,
MLP width, vocabulary); their MLPs are gated (three matrices, SwiGLU), unlike the course's GPT.
"""

from __future__ import annotations

from dataclasses import dataclass

from labcode.checks import fail, is_int
from labcode.cost import kv_cache_bytes
from labcode.roofline import Machine, StepCost, predict


@dataclass(frozen=True)
class ModelShape:
    """The shape of a published decoder-only model, as its configuration file gives it."""

    name: str
    n_layers: int  # L (num_hidden_layers)
    n_heads: int  # H (num_attention_heads)
    n_kv_heads: int  # Hkv (num_key_value_heads)
    head_dim: int  # D (hidden_size / num_attention_heads)
    d_model: int  # C (hidden_size)
    d_ff: int  # MLP width (intermediate_size)
    vocab_size: int  # V
    context_length: int  # max_position_embeddings
    gated_mlp: bool = True  # three MLP matrices (gate, up, down) instead of two
    tied_embeddings: bool = False  # tie_word_embeddings: the output head is the input embedding
    source: str = ""  # where the numbers were read

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "d_ff", "vocab_size",
                     "context_length"):
            if not (is_int(getattr(self, name)) and getattr(self, name) > 0):
                fail(f"ModelShape.{name}", "a positive int", repr(getattr(self, name)))

    def layer_params(self) -> int:
        """Weights of the layers' products: q, k, v, out and the MLP in each layer."""
        c, d = self.d_model, self.head_dim
        attention = c * self.n_heads * d + 2 * c * self.n_kv_heads * d + self.n_heads * d * c
        mlp = (3 if self.gated_mlp else 2) * c * self.d_ff
        return self.n_layers * (attention + mlp)

    def head_params(self) -> int:
        """Weights of the output head, C V (the input embedding has as many)."""
        return self.d_model * self.vocab_size

    def matmul_params(self) -> int:
        """Weights of every product of a token that gets logits: the layers' and the output head's."""
        return self.layer_params() + self.head_params()

    def params(self) -> int:
        """Weights held: the products' and, unless it is tied to the head, the input embedding (norms and
        biases, under 0.1 % of these models, left out)."""
        return self.matmul_params() + (0 if self.tied_embeddings else self.head_params())

    def kv_bytes(self, tokens: int, bytes_per_element: int = 2) -> int:
        """Cache bytes of one sequence of `tokens` tokens: 2 L T Hkv D elements."""
        return kv_cache_bytes(self.n_layers, 1, tokens, self.n_kv_heads, self.head_dim, bytes_per_element)


# Published configurations (config.json on the Hugging Face Hub), read for chapter 10.
MODELS = {
    "LLaMA-2-7B-32K": ModelShape("LLaMA-2-7B-32K", 32, 32, 32, 128, 4096, 11008, 32000, 32768,
                                 source="huggingface.co/togethercomputer/LLaMA-2-7B-32K"),
    "Qwen2.5-7B": ModelShape("Qwen2.5-7B", 28, 28, 4, 128, 3584, 18944, 152064, 32768,
                             source="huggingface.co/Qwen/Qwen2.5-7B-Instruct"),
    "Qwen2.5-72B": ModelShape("Qwen2.5-72B", 80, 64, 8, 128, 8192, 29568, 152064, 32768,
                              source="huggingface.co/Qwen/Qwen2.5-72B-Instruct"),
}

# NVIDIA H100 SXM's datasheet: 1,979 TFLOP/s of BF16 tensor-core maths with 2:4 sparsity, half that
# dense, and 3.35 TB/s of HBM3 bandwidth.
H100 = Machine(peak_flops_per_s=1979e12 / 2, bandwidth_bytes_per_s=3.35e12)
LINKS_GBIT = (25, 400)  # a 25 Gbit/s Ethernet port, a 400 Gbit/s InfiniBand NDR or RoCE port


def prefill_cost(shape: ModelShape, tokens: int, bytes_per_element: int = 2) -> StepCost:
    """FLOPs and bytes of a prefill of `tokens` tokens, as chapter 7's `StepCost`.

    Causal attention counted as computed by a kernel that skips masked blocks: T(T+1)/2 query-key
    pairs per head and layer. The output head runs for the last token only: the cache and the next
    token need no other logits. Bytes: every weight once, the new keys and values written and read
    once; activations stay on chip (a fused kernel's best case), so the bytes are a floor too.
    """
    if not (is_int(tokens) and tokens > 0):
        fail("tokens", "a positive int", repr(tokens))
    pairs = tokens * (tokens + 1) // 2
    kv = shape.kv_bytes(tokens, bytes_per_element)
    return StepCost(
        flops_linear=2 * tokens * shape.layer_params() + 2 * shape.head_params(),
        flops_attention=4 * shape.n_layers * shape.n_heads * shape.head_dim * pairs,
        weight_bytes=bytes_per_element * shape.matmul_params(),
        kv_read_bytes=kv, kv_write_bytes=kv,
        act_linear_bytes=0, act_attention_bytes=0, act_other_bytes=0,
    )


def recompute_seconds(shape: ModelShape, tokens: int, machine: Machine = H100, bytes_per_element: int = 2) -> float:
    """The roofline's seconds for computing a cache of `tokens` tokens again (a lower bound: peak rates)."""
    return predict(prefill_cost(shape, tokens, bytes_per_element), machine).seconds


def ship_seconds(nbytes: int, gbit_per_s: float) -> float:
    """Seconds a link of `gbit_per_s` Gbit/s needs for `nbytes` bytes at its line rate."""
    if not (is_int(nbytes) and nbytes >= 0):
        fail("nbytes", "an int >= 0", repr(nbytes))
    if not (isinstance(gbit_per_s, (int, float)) and not isinstance(gbit_per_s, bool) and gbit_per_s > 0):
        fail("gbit_per_s", "a positive rate", repr(gbit_per_s))
    return 8 * nbytes / (gbit_per_s * 1e9)


def crossover_gbit_per_s(shape: ModelShape, tokens: int, machine: Machine = H100, bytes_per_element: int = 2) -> float:
    """The link rate (Gbit/s) at which shipping the cache takes as long as computing it again."""
    return 8 * shape.kv_bytes(tokens, bytes_per_element) / recompute_seconds(shape, tokens, machine,
                                                                             bytes_per_element) / 1e9


def cost_table(tokens: int = 32768, models: dict[str, ModelShape] | None = None, links: tuple = LINKS_GBIT,
               machine: Machine = H100, bytes_per_element: int = 2) -> list[dict]:
    """One row per model: its shape, its cache at `tokens` tokens, the seconds to ship it over each link,
    the seconds to compute it again, and the crossover link rate."""
    rows = []
    for name, shape in (MODELS if models is None else models).items():
        nbytes = shape.kv_bytes(tokens, bytes_per_element)
        row = {"model": name, "layers": shape.n_layers, "heads": shape.n_heads, "kv_heads": shape.n_kv_heads,
               "head_dim": shape.head_dim, "params": shape.matmul_params(), "kv_bytes": nbytes}
        for rate in links:
            row[f"ship_{rate}g_s"] = ship_seconds(nbytes, rate)
        row["recompute_s"] = recompute_seconds(shape, tokens, machine, bytes_per_element)
        row["crossover_gbit"] = crossover_gbit_per_s(shape, tokens, machine, bytes_per_element)
        rows.append(row)
    return rows
