"""Every lever that makes the cache smaller, measured one way: what the chapter on smaller caches compares.

Introduced in the chapter on smaller caches; `qa/smaller_caches.ipynb` runs it on the real model.
The levers that change the model rather than the cache (fewer key/value heads, a low-rank latent)
are applied to a trained model here without the training they are normally built with, in place
and undone on exit, so that their quality is measured on the same weights as every other lever:

  * `expand_kv_heads`: the MHA model with the same function as a GQA model (each key/value head
    repeated for the query heads that share it): equal logits, G times the cache;
  * `averaged_kv_heads`: the G = H grouping of a GQA model made by averaging its key/value heads'
    projections (the initialisation GQA's authors uptrain from), untrained;
  * `low_rank_kv`: each layer's key/value projection replaced by its best rank-r approximation
    (singular values), so every token's keys and values are one fixed matrix times a latent of
    width r: what a latent cache would hold, before the keys' rotation (so without MLA's separate
    rotary key), untrained.

`compare_logits` is the quality every lever is given; `passkey_prompt` builds the retrieval task;
`lever_bytes` the bytes per token of context each lever keeps, at 16 bits an element.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from labcode.checks import fail, is_int
from labcode.cost import kv_cache_bytes
from labcode.engines.kivi import kivi_bytes
from labcode.mla import latent_bytes_per_token
from labcode.model import GPT


def compare_logits(out: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    """How far logits out [1, N, V] are from the reference ref [1, N, V] predicting targets [1, N]: mean KL
    divergence KL(ref || out) in nats, largest |logit difference|, share of positions whose top token agrees,
    and the mean next-token loss of each (nats)."""
    if out.shape != ref.shape or out.dim() != 3 or targets.shape != out.shape[:2]:
        fail("out, ref, targets", "logits [1, N, V], [1, N, V] and ids [1, N]",
             f"{tuple(out.shape)}, {tuple(ref.shape)}, {tuple(targets.shape)}")
    lp, lq = ref.double().log_softmax(-1), out.double().log_softmax(-1)
    return {"mean_kl": (lp.exp() * (lp - lq)).sum(-1).mean().item(),
            "max_logit_diff": (out - ref).abs().max().item(),
            "top1_agreement": (out.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "loss": F.cross_entropy(out[0].double(), targets[0]).item(),
            "loss_full": F.cross_entropy(ref[0].double(), targets[0]).item()}


def _kv_weights(model: GPT) -> list[torch.Tensor]:
    """Each layer's key/value projection weight [2 Hkv D, C] (K rows, then V rows), refusing biases."""
    weights = []
    for block in model.blocks:
        proj = block.attn.kv_proj
        if proj.bias is not None:
            fail("model", "key/value projections without bias (a bias is not a product with the latent)",
                 "a bias in kv_proj")
        weights.append(proj.weight)
    return weights


@contextmanager
def _replaced(model: GPT, new: list[torch.Tensor]):
    """The key/value projection weights replaced by `new` inside the block, restored after it."""
    old = [w.detach().clone() for w in _kv_weights(model)]
    try:
        for w, n in zip(_kv_weights(model), new, strict=True):
            w.data.copy_(n)
        yield
    finally:
        for w, o in zip(_kv_weights(model), old, strict=True):
            w.data.copy_(o)


@contextmanager
def low_rank_kv(model: GPT, rank: int):
    """Inside the block, each layer's key/value projection is its rank-`rank` approximation (by singular
    values, computed in float64): K and V of every token are U_r times a latent of width r."""
    width = 2 * model.cfg.n_kv_heads * model.cfg.head_dim
    if not (is_int(rank) and 0 < rank <= width):
        fail("rank", f"an int in [1, 2 Hkv D = {width}]", repr(rank))
    new = []
    for w in _kv_weights(model):
        u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
        new.append(((u[:, :rank] * s[:rank]) @ vh[:rank]).to(w.dtype))
    with _replaced(model, new):
        yield


@contextmanager
def averaged_kv_heads(model: GPT):
    """Inside the block, every key/value head of a layer has the mean of their projections: one head's keys
    and values repeated (the cache of an MQA model), untrained."""
    hkv, d = model.cfg.n_kv_heads, model.cfg.head_dim
    new = []
    for w in _kv_weights(model):
        heads = w.view(2, hkv, d, -1)  # (K or V, head, D, C)
        new.append(heads.mean(1, keepdim=True).expand_as(heads).reshape(w.shape))
    with _replaced(model, new):
        yield


def expand_kv_heads(model: GPT) -> GPT:
    """The MHA model that computes what the GQA `model` computes: each key/value head repeated for the
    G query heads that share it (query head h reads key/value head h // G)."""
    cfg = model.cfg
    g = cfg.n_heads // cfg.n_kv_heads
    with torch.device("meta"):  # no storage until the weights are assigned
        mha = GPT(cfg.with_(n_kv_heads=cfg.n_heads)).eval()
    state = dict(model.state_dict())
    for i, w in enumerate(_kv_weights(model)):
        heads = w.view(2, cfg.n_kv_heads, cfg.head_dim, -1).repeat_interleave(g, dim=1)
        state[f"blocks.{i}.attn.kv_proj.weight"] = heads.reshape(-1, w.shape[1])
    mha.load_state_dict(state, assign=True)
    return mha


def passkey_prompt(encode, filler: list[int], depth: float, key: str) -> tuple[list[int], list[int]]:
    """A retrieval prompt: an instruction, the filler ids with a pass key planted at `depth` (a fraction of
    the filler), and the question -> (context ids, answer ids). The answer is " The pass key is <key>"; its
    last len(key) tokens are the key's digits when the tokenizer splits digits (checked)."""
    if not 0 <= depth <= 1:
        fail("depth", "a fraction in [0, 1]", repr(depth))
    if not (isinstance(key, str) and key.isdigit()):
        fail("key", "a string of digits", repr(key))
    at = round(depth * len(filler))
    context = (encode("A pass key is hidden in the text below. Remember it.\n\n") + filler[:at]
               + encode(f"\n\nThe pass key is {key}. Remember it. The pass key is {key}.\n\n") + filler[at:]
               + encode("\n\nWhat is the pass key?"))
    answer = encode(f" The pass key is {key}")
    if answer[-len(key):] != [encode(c)[0] for c in key]:
        fail("key", "digits the tokenizer encodes one token each", repr(key))
    return context, answer


def lever_bytes(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, tokens: int, lever: str,
                **kw) -> float:
    """Bytes per token of a context of `tokens` tokens that a lever's cache keeps, at 16 bits an element
    (scales and zero points 16 bits too, int4 codes two to a byte).

    lever: "mha", "gqa", "mqa"; "latent" (rank=r, rope_dim=dR); "int8" / "int4" (group=channels per scale,
    None: one per head and token); "kivi" (bits, group, residual); "evict" (budget keys per head, kept at 16
    bits: window, sinks, H2O, SnapKV alike; H2O's scores are not counted)."""
    el = 2
    heads = {"mha": n_heads, "gqa": n_kv_heads, "mqa": 1}
    if lever in heads:
        return kv_cache_bytes(n_layers, 1, 1, heads[lever], head_dim, el)
    if lever == "latent":
        return latent_bytes_per_token(n_layers, kw["rank"], kw.get("rope_dim", 0), el)
    if lever in ("int8", "int4"):
        bits, group = int(lever[3:]), kw.get("group") or head_dim
        return 2 * n_layers * n_kv_heads * (head_dim * bits // 8 + head_dim // group * el)
    if lever == "kivi":
        return kivi_bytes(n_layers, n_kv_heads, head_dim, tokens, kw["bits"], kw["group"], kw["residual"]) / tokens
    if lever == "evict":
        return kv_cache_bytes(n_layers, 1, min(kw["budget"], tokens), n_kv_heads, head_dim, el) / tokens
    fail("lever", "one of mha, gqa, mqa, latent, int8, int4, kivi, evict", repr(lever))
