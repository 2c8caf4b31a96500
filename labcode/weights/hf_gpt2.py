"""The bridge to Hugging Face transformers: the course's GPT as a `GPT2LMHeadModel`, and back.

Introduced in chapter 9. The course's model is GPT-2 exactly: the same learned position table,
pre-LayerNorm blocks (eps 1e-5), tanh-approximated GELU and tied output head. Only the storage
differs: the course keeps `q_proj` and `kv_proj` as `nn.Linear` ([out, in]); GPT-2 keeps one
fused `c_attn` (Q, K, V in that order) and stores every projection as `Conv1D` ([in, out]).
`load_pretrained_gpt2` (in `labcode.weights.pretrained`, which imports this module only when the weights are
there) brings OpenAI's weights into the course model for readers who are online; it never downloads
unless asked to.
"""

from __future__ import annotations

import warnings

import torch
from tqdm import TqdmWarning

with warnings.catch_warnings():  # in a notebook without ipywidgets, transformers' tqdm.auto warns on import
    warnings.simplefilter("ignore", TqdmWarning)
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from labcode.config import GPTConfig
from labcode.model import GPT
from labcode.tokenizer import Tokenizer
from labcode.weights.checkpoint import default_device

# Both spell GPT-2's tanh approximation of GELU (the course's `nn.GELU(approximate="tanh")`):
# "gelu_new" is OpenAI's formula written out, "gelu_pytorch_tanh" calls the same PyTorch kernel.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
LAYER_NORM_EPS = 1e-5  # the course's LayerNorms


class ConversionError(ValueError):
    """A model or config that the other side cannot express; raised before anything is built."""


def expect(ok: bool, argument: str, expected: str, got: object) -> None:
    if not ok:
        raise ConversionError(f"{argument}: expected {expected}, got {got!r}")


# -- configs ----------------------------------------------------------------------------------------

def hf_config(cfg: GPTConfig) -> GPT2Config:
    """The `GPT2Config` of a course config; raises ConversionError for what GPT-2 cannot express."""
    expect(isinstance(cfg, GPTConfig), "cfg", "a GPTConfig", type(cfg).__name__)
    expect(not cfg.rotary, "cfg.rotary", "False (GPT-2 has a learned position table, no rotary positions)",
            cfg.rotary)
    expect(cfg.n_kv_heads == cfg.n_heads, "cfg.n_kv_heads",
            f"n_heads = {cfg.n_heads} (GPT-2 has no grouped-query attention)", cfg.n_kv_heads)
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=LAYER_NORM_EPS,
        # The course has one dropout rate, applied where GPT-2 applies its three.
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=True,
        # The course has no special tokens; GPT-2's <|endoftext|> (50256) would stop HF's generate early.
        bos_token_id=None, eos_token_id=None,
    )


def gpt_config(config: GPT2Config) -> GPTConfig:
    """The course config of a `GPT2Config`; raises ConversionError for what the course model cannot express."""
    expect(getattr(config, "model_type", None) == "gpt2", "config.model_type", "'gpt2'",
            getattr(config, "model_type", type(config).__name__))
    c = config.n_embd
    expect(config.activation_function in TANH_GELU, "config.activation_function",
            f"one of {TANH_GELU} (the tanh GELU)", config.activation_function)
    expect(config.layer_norm_epsilon == LAYER_NORM_EPS, "config.layer_norm_epsilon", LAYER_NORM_EPS,
            config.layer_norm_epsilon)
    expect(config.n_inner in (None, 4 * c), "config.n_inner", f"None or 4 * n_embd = {4 * c}", config.n_inner)
    expect(config.scale_attn_weights, "config.scale_attn_weights", "True (scores scaled by 1/sqrt(D))",
            config.scale_attn_weights)
    expect(not config.scale_attn_by_inverse_layer_idx, "config.scale_attn_by_inverse_layer_idx", "False",
            config.scale_attn_by_inverse_layer_idx)
    # It computes scores in float32 whatever the model's dtype, which float64 comparisons would see.
    expect(not config.reorder_and_upcast_attn, "config.reorder_and_upcast_attn", "False",
            config.reorder_and_upcast_attn)
    expect(not config.add_cross_attention, "config.add_cross_attention", "False", config.add_cross_attention)
    expect(config.tie_word_embeddings, "config.tie_word_embeddings", "True (the course ties its head)",
            config.tie_word_embeddings)
    drops = (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop)
    expect(len(set(drops)) == 1, "config.resid_pdrop, embd_pdrop, attn_pdrop",
            "one rate (the course model has a single dropout)", drops)
    return GPTConfig(vocab_size=config.vocab_size, context_length=config.n_positions, n_layers=config.n_layer,
                     n_heads=config.n_head, d_model=c, dropout=float(drops[0]))


# -- weights ----------------------------------------------------------------------------------------

def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The course model's weights under GPT-2's names and layouts (Conv1D weights are [in, out])."""
    sd = model.state_dict()
    out = {"transformer.wte.weight": sd["tok_emb.weight"], "transformer.wpe.weight": sd["pos_emb.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"],
           "lm_head.weight": sd["tok_emb.weight"]}  # tied
    for i in range(model.cfg.n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + f"{ln}.weight"], out[dst + f"{ln}.bias"] = sd[src + f"{ln}.weight"], sd[src + f"{ln}.bias"]
        # kv_proj's rows are K then V (the model views them as (2, Hkv, D)), so Q | K | V is c_attn's order.
        out[dst + "attn.c_attn.weight"] = torch.cat((sd[src + "attn.q_proj.weight"],
                                                     sd[src + "attn.kv_proj.weight"])).t()  # (C, 3C)
        out[dst + "attn.c_attn.bias"] = torch.cat((sd[src + "attn.q_proj.bias"], sd[src + "attn.kv_proj.bias"]))
        pairs = {"attn.c_proj": "attn.out_proj", "mlp.c_fc": "mlp.0", "mlp.c_proj": "mlp.2"}
        for hf_name, name in pairs.items():
            out[dst + f"{hf_name}.weight"] = sd[src + f"{name}.weight"].t()  # Linear [out, in] -> Conv1D [in, out]
            out[dst + f"{hf_name}.bias"] = sd[src + f"{name}.bias"]
    return out


def course_state_dict(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2's weights (`hf_state_dict`'s names) under the course's names and layouts."""
    c = cfg.d_model
    out = {"tok_emb.weight": state["transformer.wte.weight"], "pos_emb.weight": state["transformer.wpe.weight"],
           "ln_f.weight": state["transformer.ln_f.weight"], "ln_f.bias": state["transformer.ln_f.bias"]}
    for i in range(cfg.n_layers):
        src, dst = f"transformer.h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + f"{ln}.weight"], out[dst + f"{ln}.bias"] = state[src + f"{ln}.weight"], state[src + f"{ln}.bias"]
        w, b = state[src + "attn.c_attn.weight"].t(), state[src + "attn.c_attn.bias"]  # (3C, C), (3C,)
        out[dst + "attn.q_proj.weight"], out[dst + "attn.kv_proj.weight"] = w[:c], w[c:]
        out[dst + "attn.q_proj.bias"], out[dst + "attn.kv_proj.bias"] = b[:c], b[c:]
        pairs = {"attn.out_proj": "attn.c_proj", "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}
        for name, hf_name in pairs.items():
            out[dst + f"{name}.weight"] = state[src + f"{hf_name}.weight"].t()
            out[dst + f"{name}.bias"] = state[src + f"{hf_name}.bias"]
    return out


def to_hf(model: GPT, attn_implementation: str | None = None) -> GPT2LMHeadModel:
    """A `GPT2LMHeadModel` computing what `model` computes: same weights (copied), dtype, device, train/eval mode.

    `attn_implementation` ("eager", "sdpa", ...) picks Hugging Face's attention kernel (None: its default).
    """
    expect(isinstance(model, GPT), "model", "a labcode GPT", type(model).__name__)
    config = hf_config(model.cfg)
    config.dtype = model.dtype  # what save_pretrained records
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):  # no random init of weights that are overwritten at once
        hf = GPT2LMHeadModel(config)
    state = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in hf_state_dict(model).items()}
    hf.load_state_dict(state, strict=True, assign=True)
    hf.tie_weights()  # assign=True replaced the tied head with its own copy; share the embedding again
    expect(hf.lm_head.weight is hf.transformer.wte.weight, "lm_head.weight", "tied to transformer.wte.weight",
            "a separate tensor")
    no_meta(hf, "to_hf")
    return hf.train(model.training)


def no_meta(module: torch.nn.Module, where: str) -> None:
    """Raise if a tensor built on the meta device (a parameter, a buffer or a plain tensor attribute)
    was not set by the loaded weights."""
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    left += [f"{prefix}.{k}".lstrip(".") for prefix, m in module.named_modules() for k, v in vars(m).items()
             if isinstance(v, torch.Tensor) and v.is_meta]
    if left:
        raise RuntimeError(f"{where}: expected every tensor set by the weights, got unset {sorted(set(left))}")


def from_hf(hf_model: GPT2LMHeadModel) -> GPT:
    """The course model computing what `hf_model` computes: same weights (copied), dtype, device, train/eval mode."""
    expect(isinstance(hf_model, GPT2LMHeadModel), "hf_model", "a transformers GPT2LMHeadModel",
            type(hf_model).__name__)
    cfg = gpt_config(hf_model.config)
    state = hf_model.state_dict()
    expect(torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]), "hf_model.lm_head.weight",
            "equal to transformer.wte.weight (a tied head)", "a different tensor")
    weight = state["transformer.wte.weight"]
    with torch.device("meta"):  # shapes and layouts only: the random init of a 124M model costs seconds
        model = GPT(cfg)
    model = model.to_empty(device=weight.device).to(dtype=weight.dtype)
    missing = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    if missing:  # a non-persistent buffer would be left uninitialised by to_empty
        raise RuntimeError(f"from_hf: expected no buffers outside the state_dict, got {sorted(missing)}")
    model.load_state_dict(course_state_dict(state, cfg), strict=True)
    no_meta(model, "from_hf")
    return model.train(hf_model.training)


# -- real GPT-2 weights -----------------------------------------------------------------------------

class HFTokenizer(Tokenizer):
    """A transformers tokenizer behind the interface of `labcode.tokenizer.CharTokenizer`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Text to a list of ids (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        """A sequence (or 1-D tensor) of ids to text; raises ValueError for an id outside the vocabulary."""
        return self.tokenizer.decode(self.ids_in_vocabulary(ids))


def read_pretrained(name: str, download: bool, dtype: torch.dtype,
                    device: str | torch.device | None) -> tuple[GPT, HFTokenizer]:
    """GPT-2 weights `name` read by transformers (from the local cache only unless `download`) as a course
    model in eval mode, with their tokenizer: the work behind `labcode.weights.pretrained.load_pretrained_gpt2`,
    which asks for it once it knows the weights are there. Raises OSError, as transformers does, when
    they are not."""
    hf = GPT2LMHeadModel.from_pretrained(name, local_files_only=not download)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(name, local_files_only=not download))
    expect(tok.vocab_size <= hf.config.vocab_size, "tokenizer", f"at most the model's {hf.config.vocab_size} ids",
            tok.vocab_size)
    model = from_hf(hf).to(device=default_device() if device is None else torch.device(device), dtype=dtype)
    return model.eval(), tok
