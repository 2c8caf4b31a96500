"""The bridge to Hugging Face for the Llama family: the course's model as a `LlamaForCausalLM`, and back.

Introduced in chapter 1 (the real model) beside chapter 9's GPT-2 bridge (`labcode.weights.hf_gpt2`).
The computation is the same; the storage differs: the course keeps K and V in one `kv_proj` (K rows
then V rows) where Llama has `k_proj` and `v_proj`, and its names are the course's.

transformers computes RMSNorm and the rotary angles in float32 whatever the model's dtype, so a
float64 comparison would measure float32 rounding. `model_dtype_throughout()` runs its Llama with
both in the model's dtype, for the float64 checks; without it the two agree to float32 rounding.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from tqdm import TqdmWarning

with warnings.catch_warnings():  # in a notebook without ipywidgets, transformers' tqdm.auto warns on import
    warnings.simplefilter("ignore", TqdmWarning)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

from labcode.config import GPTConfig
from labcode.model import GPT
from labcode.weights.hf_gpt2 import ConversionError as ConversionError  # what both bridges raise
from labcode.weights.hf_gpt2 import expect as _expect
from labcode.weights.hf_gpt2 import no_meta


def hf_llama_config(cfg: GPTConfig) -> LlamaConfig:
    """The `LlamaConfig` of a Llama-family course config; ConversionError for what Llama cannot express."""
    wants = {"rotary": True, "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "sliding_window": None,
             "dropout": 0.0}
    for field, value in wants.items():
        _expect(getattr(cfg, field) == value, f"cfg.{field}", f"{value!r} (a Llama-family model)", getattr(cfg, field))
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama_gpt_config(config: LlamaConfig) -> GPTConfig:
    """The course config of a `LlamaConfig`; ConversionError for what the course model cannot express."""
    _expect(getattr(config, "model_type", None) == "llama", "config.model_type", "'llama'",
            getattr(config, "model_type", type(config).__name__))
    rope = config.rope_parameters or {}
    _expect(rope.get("rope_type", "default") == "default", "config.rope_parameters", "the default rotary", rope)
    _expect(config.head_dim == config.hidden_size // config.num_attention_heads, "config.head_dim",
            "hidden_size // num_attention_heads", config.head_dim)
    _expect(config.tie_word_embeddings, "config.tie_word_embeddings", "True (the course ties its head)",
            config.tie_word_embeddings)
    _expect(not config.attention_bias and not config.mlp_bias, "config.attention_bias, mlp_bias", "False",
            (config.attention_bias, config.mlp_bias))
    _expect(config.hidden_act == "silu", "config.hidden_act", "'silu'", config.hidden_act)
    return GPTConfig(vocab_size=config.vocab_size, context_length=config.max_position_embeddings,
                     n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
                     n_kv_heads=config.num_key_value_heads, d_model=config.hidden_size, rotary=True,
                     rope_base=float(rope["rope_theta"]), norm="rmsnorm", norm_eps=config.rms_norm_eps,
                     mlp="swiglu", d_ff=config.intermediate_size, bias=False)


# course name -> Llama name, per block (kv_proj is split into k_proj and v_proj)
BLOCK_NAMES = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
               "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.out_proj.weight": "self_attn.o_proj.weight",
               "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
               "mlp.down.weight": "mlp.down_proj.weight"}


def hf_llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The course model's weights under Llama's names (every weight is [out, in] on both sides)."""
    sd, kv = model.state_dict(), model.cfg.n_kv_heads * model.cfg.head_dim
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["ln_f.weight"],
           "lm_head.weight": sd["tok_emb.weight"]}  # tied
    for i in range(model.cfg.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out |= {dst + theirs: sd[src + ours] for ours, theirs in BLOCK_NAMES.items()}
        k, v = sd[src + "attn.kv_proj.weight"].split(kv)  # K rows, then V rows
        out[dst + "self_attn.k_proj.weight"], out[dst + "self_attn.v_proj.weight"] = k, v
    return out


def course_llama_state_dict(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Llama's weights (`hf_llama_state_dict`'s names) under the course's names."""
    out = {"tok_emb.weight": state["model.embed_tokens.weight"], "ln_f.weight": state["model.norm.weight"]}
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        out |= {dst + ours: state[src + theirs] for ours, theirs in BLOCK_NAMES.items()}
        out[dst + "attn.kv_proj.weight"] = torch.cat((state[src + "self_attn.k_proj.weight"],
                                                      state[src + "self_attn.v_proj.weight"]))
    return out


def to_hf_llama(model: GPT) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` computing what `model` computes: same weights (copied), dtype, device, mode."""
    _expect(isinstance(model, GPT), "model", "a labcode GPT", type(model).__name__)
    config = hf_llama_config(model.cfg)
    config.dtype = model.dtype
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    state = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in hf_llama_state_dict(model).items()}
    hf.load_state_dict(state, strict=True, assign=True)
    hf.tie_weights()
    _expect(hf.lm_head.weight is hf.model.embed_tokens.weight, "lm_head.weight", "tied to embed_tokens",
            "a separate tensor")
    rotary = hf.model.rotary_emb  # its frequencies are a non-persistent buffer: computed, not loaded
    inv_freq, _ = rotary.compute_default_rope_parameters(config)
    rotary.inv_freq = inv_freq.to(model.device)
    rotary.original_inv_freq = rotary.inv_freq.clone()
    no_meta(hf, "to_hf_llama")
    return hf.train(model.training)


def from_hf_llama(hf_model: LlamaForCausalLM) -> GPT:
    """The course model computing what `hf_model` computes: same weights (copied), dtype, device, mode."""
    _expect(isinstance(hf_model, LlamaForCausalLM), "hf_model", "a transformers LlamaForCausalLM",
            type(hf_model).__name__)
    cfg = llama_gpt_config(hf_model.config)
    state = hf_model.state_dict()
    _expect(torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]), "hf_model.lm_head.weight",
            "equal to model.embed_tokens.weight (a tied head)", "a different tensor")
    weight = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device=weight.device).to(dtype=weight.dtype)
    model.load_state_dict(course_llama_state_dict(state, cfg), strict=True)
    no_meta(model, "from_hf_llama")
    return model.train(hf_model.training)


def _rms_norm(self, x: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm.forward, in x's dtype
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor):  # LlamaRotaryEmbedding.forward, in x's dtype
    base = self.config.rope_parameters["rope_theta"]
    d = self.inv_freq.numel() * 2
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


@contextlib.contextmanager
def model_dtype_throughout():
    """Within this block, transformers' Llama computes its RMSNorm and rotary angles in the model's dtype
    (it upcasts both to float32 otherwise); everything else of it is unchanged."""
    saved = modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward
    modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward = _rms_norm, _rotary
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaRotaryEmbedding.forward = saved
