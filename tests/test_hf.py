"""The bridge to Hugging Face (`labcode.weights.hf_gpt2`): the course's GPT is GPT-2, logit for logit.

Models are built from configs and weights from seeded generators; nothing is downloaded. The
GPT-2-shaped checks run at GPT-2 124M's width (C = 768, H = 12) over its whole position table
(1024 positions) with one block and a small vocabulary: a block and the position table are what
the conversion maps, and a 50257-row head over 1024 positions in float64 would cost seconds on two
cores for no extra claim. The pretrained path is tested on a random model of GPT-2 124M's exact
shape and config, saved to a temporary folder.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

from labcode import GPT, get_config
from labcode.caches import ConcatCache
from labcode.generate import generate, generate_nocache
from labcode.tokenizer import CharTokenizer
from labcode.weights.checkpoint import load_checkpoint
from labcode.weights.hf_gpt2 import (
    ConversionError,
    HFTokenizer,
    from_hf,
    gpt_config,
    hf_config,
    hf_state_dict,
    to_hf,
)
from labcode.weights.pretrained import PretrainedUnavailable, load_pretrained_gpt2, main, pretrained_available

TOL64 = 1e-12  # float64: the course's bar for "the same computation"
TOL32 = 1e-4  # float32 logits: rounding of a 124M-parameter model, with room for other CPUs' kernels
PROMPT = "The sleepy fox walked to the mill."

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing here may reach the Hugging Face Hub: huggingface_hub refuses every request in offline mode."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def random_ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny64() -> GPT:
    return load_checkpoint(device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def gpt2_width() -> GPT:
    """A random float64 model at GPT-2 124M's width and position table, one block, V = 512."""
    torch.manual_seed(0)
    cfg = get_config("gpt2-124m").with_(n_layers=1, vocab_size=512)
    return GPT(cfg).to(torch.float64).eval()


# -- logits --------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shipped_checkpoint_gives_the_same_logits_in_hf(tiny64, attn):
    hf = to_hf(tiny64, attn_implementation=attn)
    assert hf.dtype == torch.float64 and not hf.training and hf.config._attn_implementation == attn
    ctx = tiny64.cfg.context_length
    ids = torch.cat((CharTokenizer().encode_tensor(PROMPT * 2)[:, :ctx], random_ids(1, ctx, 64)))  # (2, ctx)
    with torch.no_grad():
        ours, theirs = tiny64(ids), hf(ids).logits
    assert theirs.dtype == torch.float64
    assert max_diff(ours, theirs) <= TOL64


def test_gpt2_width_model_over_the_whole_position_table(gpt2_width):
    hf = to_hf(gpt2_width)
    ids = random_ids(1, gpt2_width.cfg.context_length, gpt2_width.cfg.vocab_size)  # exactly 1024 positions
    with torch.no_grad():
        ours, theirs = gpt2_width(ids), hf(ids).logits
    assert ours.shape == theirs.shape == (1, 1024, 512)
    assert max_diff(ours, theirs) <= TOL64


def test_a_wrong_mapping_is_caught(tiny64):
    """K and V swapped inside c_attn: the comparison above must see it."""
    hf = to_hf(tiny64)
    c = tiny64.cfg.d_model
    with torch.no_grad():
        w, b = hf.transformer.h[0].attn.c_attn.weight, hf.transformer.h[0].attn.c_attn.bias
        w.copy_(torch.cat((w[:, :c], w[:, 2 * c:], w[:, c:2 * c]), dim=1))
        b.copy_(torch.cat((b[:c], b[2 * c:], b[c:2 * c])))
        ids = CharTokenizer().encode_tensor(PROMPT)
        assert max_diff(tiny64(ids), hf(ids).logits) > 1e-3


# -- round trips ---------------------------------------------------------------------------------

def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_round_trip_course_hf_course_is_exact(dtype):
    model = load_checkpoint(device="cpu", dtype=dtype)
    back = from_hf(to_hf(model))
    assert back.cfg == model.cfg and not back.training
    assert_same_tensors(back.state_dict(), model.state_dict())


def test_round_trip_keeps_width_dropout_and_train_mode(gpt2_width):
    model = GPT(get_config("micro", dropout=0.1)).train()
    hf = to_hf(model)
    assert hf.training and (hf.config.resid_pdrop, hf.config.embd_pdrop, hf.config.attn_pdrop) == (0.1, 0.1, 0.1)
    back = from_hf(hf)
    assert back.cfg == model.cfg and back.training
    assert_same_tensors(back.state_dict(), model.state_dict())
    assert_same_tensors(from_hf(to_hf(gpt2_width)).state_dict(), gpt2_width.state_dict())


def test_round_trip_hf_course_hf_is_exact():
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=3, n_head=6, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf = GPT2LMHeadModel(config).eval()
    model = from_hf(hf)
    assert model.cfg == get_config("micro").with_(vocab_size=96, context_length=32, n_layers=3, n_heads=6,
                                                    d_model=48)
    assert_same_tensors(to_hf(model).state_dict(), hf.state_dict())
    assert_same_tensors(hf_state_dict(model), {k: v for k, v in hf.state_dict().items()})


# -- generation with Hugging Face's cache --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_generation_with_hf_cache_gives_the_course_tokens(dtype):
    model = load_checkpoint(device="cpu", dtype=dtype)
    hf = to_hf(model)
    ids = CharTokenizer().encode_tensor(PROMPT[:14])
    n = model.cfg.context_length - ids.shape[1]  # up to the last row of the position table
    ours = generate(model, ids, n, ConcatCache(model.cfg.n_layers))
    reference = generate_nocache(model, ids, n)
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         past_key_values=DynamicCache(config=hf.config))
    assert torch.equal(ours.ids, reference.ids)
    assert theirs.shape == ours.ids.shape and torch.equal(theirs, ours.ids)


def test_step_logits_over_hf_dynamic_cache_match_in_float64(tiny64):
    """HF's generate returns float32 logits, so the float64 comparison runs its cache by hand."""
    hf = to_hf(tiny64)
    ids = CharTokenizer().encode_tensor(PROMPT[:10])
    n = tiny64.cfg.context_length - ids.shape[1]
    ours = generate(tiny64, ids, n, ConcatCache(tiny64.cfg.n_layers))
    cache, chunk, worst, tokens = DynamicCache(config=hf.config), ids, 0.0, []
    with torch.no_grad():
        for step in range(n):
            logits = hf(chunk, past_key_values=cache, use_cache=True).logits[:, -1]  # (1, V), float64
            assert logits.dtype == torch.float64
            worst = max(worst, max_diff(logits, ours.step_logits[step]))
            chunk = logits.argmax(-1, keepdim=True)  # (1, 1)
            tokens.append(chunk)
    assert cache.get_seq_length() == tiny64.cfg.context_length - 1  # the last token is never fed back
    assert torch.equal(torch.cat([ids, *tokens], dim=1), ours.ids)
    assert worst <= TOL64


# -- what the other side cannot express ----------------------------------------------------------

@pytest.mark.parametrize("changes,argument", [
    ({"rotary": True}, "cfg.rotary"),
    ({"n_kv_heads": 2}, "cfg.n_kv_heads"),
])
def test_course_models_gpt2_cannot_express_are_refused(changes, argument):
    cfg = get_config("tiny", **changes)
    with pytest.raises(ConversionError, match=f"^{re.escape(argument)}: expected .*, got"):
        hf_config(cfg)
    with pytest.raises(ConversionError, match=f"^{re.escape(argument)}: "):
        to_hf(GPT(cfg))


@pytest.mark.parametrize("changes,argument", [
    ({"activation_function": "gelu"}, "config.activation_function"),
    ({"layer_norm_epsilon": 1e-6}, "config.layer_norm_epsilon"),
    ({"n_inner": 100}, "config.n_inner"),
    ({"scale_attn_weights": False}, "config.scale_attn_weights"),
    ({"scale_attn_by_inverse_layer_idx": True}, "config.scale_attn_by_inverse_layer_idx"),
    ({"reorder_and_upcast_attn": True}, "config.reorder_and_upcast_attn"),
    ({"tie_word_embeddings": False}, "config.tie_word_embeddings"),
    ({"attn_pdrop": 0.2}, "config.resid_pdrop, embd_pdrop, attn_pdrop"),
])
def test_gpt2_configs_the_course_cannot_express_are_refused(changes, argument):
    base = {"vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2}
    # GPT2Config's default dropouts are 0.1: the one rate the course model keeps
    assert gpt_config(GPT2Config(**base)) == get_config("micro").with_(n_layers=1, dropout=0.1)
    config = GPT2Config(**base, **changes)
    with pytest.raises(ConversionError, match=f"^{re.escape(argument)}: expected .*, got"):
        gpt_config(config)
    with pytest.raises(ConversionError, match=f"^{re.escape(argument)}: "):
        from_hf(GPT2LMHeadModel(config))


def test_arguments_of_the_wrong_type_are_refused():
    with pytest.raises(ConversionError, match="^model: expected a labcode GPT, got 'GPT2LMHeadModel'"):
        to_hf(GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=2)))
    with pytest.raises(ConversionError, match="^hf_model: expected a transformers GPT2LMHeadModel, got 'GPT'"):
        from_hf(GPT(get_config("micro")))


# -- real weights, without downloading them ------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A folder as `save_pretrained` writes it for GPT-2 124M: its default config, random weights, and a
    small byte-level BPE tokenizer of GPT-2's kind (GPT-2's own vocabulary files would need a download)."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("gpt2-random")
    with torch.device("meta"):  # HF's own random init costs twice as much as drawing the weights here
        hf = GPT2LMHeadModel(GPT2Config())
    hf = hf.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # GPT-2's init scale, with random biases and LayerNorm gains
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.02, generator=g)
    hf.tie_weights()
    hf.save_pretrained(folder)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([PROMPT * 4], vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                      unk_token="<|endoftext|>").save_pretrained(folder)
    return folder, hf


def test_pretrained_path_end_to_end_on_a_random_gpt2_124m(gpt2_folder):
    folder, hf = gpt2_folder
    model, tok = load_pretrained_gpt2(str(folder), device="cpu")
    assert isinstance(tok, HFTokenizer) and not model.training and model.dtype == torch.float32
    assert model.cfg == get_config("gpt2-124m").with_(dropout=0.1)  # GPT-2's dropout, active only in train()
    assert model.num_params() == hf.num_parameters() == 124_439_808
    ids = tok.encode_tensor(PROMPT)
    assert tok.decode(ids[0]) == PROMPT
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert theirs.abs().max() > 1 and max_diff(ours, theirs) <= TOL32
    out = generate(model, ids, 2, ConcatCache(model.cfg.n_layers))  # random weights: any of the V ids may follow
    assert out.ids.shape == (1, ids.shape[1] + 2) and 0 <= out.ids.min() and out.ids.max() < model.cfg.vocab_size


def test_pretrained_path_reads_the_local_cache_only_unless_asked(monkeypatch):
    seen = []

    def offline(name, **kwargs):
        seen.append(kwargs)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", offline)
    with pytest.raises(PretrainedUnavailable, match=r"^name: expected GPT-2 weights 'gpt2' in the local Hugging Face "
                       r"cache, got none \(download them once: python -m labcode.weights.pretrained"):
        load_pretrained_gpt2("gpt2")
    with pytest.raises(PretrainedUnavailable, match="in the local Hugging Face cache or on the Hub, got none"):
        load_pretrained_gpt2("gpt2", download=True)
    # Without download=True the cache is looked up first (no transformers import) and transformers is
    # never asked; with it, transformers is asked to fetch.
    assert seen == [{"local_files_only": False}]
    assert main(["--download", "gpt2"]) == 1


def test_pretrained_available_looks_in_folders_and_the_cache_only(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    assert not pretrained_available(str(folder))  # a folder without a config.json
    (folder / "config.json").write_text("{}")
    assert pretrained_available(str(folder))
    cache = tmp_path / "hub"
    snapshot = cache / "models--kvcv-test--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (cache / "models--kvcv-test--cached" / "refs").mkdir()
    (cache / "models--kvcv-test--cached" / "refs" / "main").write_text("abc123")
    assert not pretrained_available("kvcv-test/cached", cache_dir=cache)  # the snapshot lacks config.json
    (snapshot / "config.json").write_text("{}")
    assert pretrained_available("kvcv-test/cached", cache_dir=cache)
    assert not pretrained_available("kvcv-test/absent-model", cache_dir=cache)
    assert not pretrained_available("not a / valid name", cache_dir=cache)


@pytest.mark.parametrize("download", [False, True])
def test_a_name_missing_from_the_cache_fails_cleanly_offline(download):
    with pytest.raises(PretrainedUnavailable, match="^name: expected GPT-2 weights 'kvcv-test/absent-model'"):
        load_pretrained_gpt2("kvcv-test/absent-model", download=download)  # offline: asking to download fails too


def test_tokenizer_adapter_rejects_ids_outside_its_vocabulary(gpt2_folder):
    from transformers import AutoTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(gpt2_folder[0]), local_files_only=True))
    n = tok.vocab_size  # what the BPE training reached, at most the 300 asked for
    assert 256 < n <= 300 and tok.decode(tok.encode(PROMPT)) == PROMPT
    with pytest.raises(ValueError, match=rf"^ids: expected values in \[0, {n}\), got {n}"):
        tok.decode([1, n])
