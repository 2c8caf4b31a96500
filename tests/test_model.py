"""Unit and property tests of the one model and the pieces around it (chapter 1).

Shapes, causality, determinism, checkpoints, sampling, tokenizer, corpus, training,
and the errors a reader gets for bad input. Equivalence is always stated on logits
with an explicit tolerance; "identical" means bitwise equal (torch.equal).
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode.config import PRESETS, GPTConfig, get_config
from labcode.corpus import make_corpus
from labcode.generate import generate_nocache
from labcode.model import GPT
from labcode.sampling import sample_next
from labcode.tokenizer import ALPHABET, CharTokenizer
from labcode.train import train
from labcode.weights.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, save_checkpoint

F64_TOL = 1e-12  # float64 logits: the course's equivalence bar

MICRO = get_config("micro")  # random weights, small enough for property tests


def build(cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT:
    """A fresh model in eval mode, its weights drawn under `seed` without touching the caller's RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(dtype).eval()


@functools.cache
def micro_model(rotary: bool = False, n_kv_heads: int | None = None) -> GPT:
    return build(MICRO.with_(rotary=rotary, n_kv_heads=n_kv_heads), seed=1)


@functools.cache
def shipped() -> GPT:
    return load_checkpoint(device="cpu")


def random_ids(cfg: GPTConfig, b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t", [(1, 1), (1, 16), (3, 5)])
def test_logits_and_hidden_shapes(b, t):
    model = micro_model()
    logits, hidden = model.run(random_ids(MICRO, b, t), keep_hidden=True)
    assert logits.shape == (b, t, MICRO.vocab_size)
    assert len(hidden) == MICRO.n_layers
    assert all(h.shape == (b, t, MICRO.d_model) for h in hidden)
    assert model(random_ids(MICRO, b, t)).shape == (b, t, MICRO.vocab_size)


@pytest.mark.parametrize("name", ["micro", "tiny"])
def test_parameter_count_matches_the_gpt2_formula(name):
    cfg = get_config(name)
    c, v, n = cfg.d_model, cfg.vocab_size, cfg.context_length
    kv = 2 * cfg.n_kv_heads * cfg.head_dim
    per_block = 2 * 2 * c + (c * c + c) + (c * kv + kv) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    expected = v * c + n * c + cfg.n_layers * per_block + 2 * c  # tied head: no extra V*C
    assert build(cfg).num_params() == expected


def test_head_is_tied_to_the_token_embedding():
    model = micro_model()
    names = [name for name, _ in model.named_parameters()]
    assert not any("head" in name for name in names)
    ids = random_ids(MICRO, 1, 4)
    before = model(ids)
    with torch.no_grad():
        saved = model.tok_emb.weight[5].clone()
        model.tok_emb.weight[5, 0] += 1.0  # token 5's embedding row is also its output row
        changed = model(ids)
        model.tok_emb.weight[5] = saved
    assert max_diff(changed[..., 5], before[..., 5]) > 1e-3
    assert torch.equal(model(ids), before)


# -- causality (property) ----------------------------------------------------------------------


def causal_case(max_len: int):
    return st.integers(2, max_len).flatmap(
        lambda t: st.tuples(
            st.lists(st.integers(0, MICRO.vocab_size - 1), min_size=t, max_size=t),
            st.integers(1, t - 1),
            st.integers(0, MICRO.vocab_size - 1),
        )
    )


def check_causal(model: GPT, tokens: list[int], j: int, new_token: int) -> None:
    ids = torch.tensor([tokens])
    changed = ids.clone()
    changed[0, j] = new_token
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert max_diff(a[:, :j], b[:, :j]) <= F64_TOL  # positions before j cannot see token j
    if new_token != tokens[j]:
        assert max_diff(a[:, j], b[:, j]) > 1e-6  # ... and position j itself does (the test can fail)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=causal_case(MICRO.context_length))
def test_changing_a_later_token_never_changes_earlier_logits(case):
    check_causal(micro_model(), *case)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=causal_case(MICRO.context_length))
def test_rotary_variant_is_causal(case):
    check_causal(micro_model(rotary=True), *case)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=causal_case(MICRO.context_length))
def test_grouped_query_variant_is_causal(case):
    check_causal(micro_model(n_kv_heads=1), *case)


# -- determinism -------------------------------------------------------------------------------


def test_two_forward_passes_are_identical():
    model, ids = micro_model(), random_ids(MICRO, 2, 9)
    assert torch.equal(model(ids), model(ids))


def test_same_seed_same_model_different_seed_different_model():
    ids = random_ids(MICRO, 1, 8)
    a, b, c = build(MICRO, seed=3), build(MICRO, seed=3), build(MICRO, seed=4)
    assert torch.equal(a(ids), b(ids))
    assert not torch.equal(a(ids), c(ids))


# -- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
    model = build(MICRO.with_(n_kv_heads=1), seed=7, dtype=torch.float32)
    path = tmp_path / "sub" / "m.pt"
    save_checkpoint(model, path, meta={"note": "round trip", "steps": 3})
    payload = torch.load(path, weights_only=True)  # tensors, numbers and strings only
    assert payload["meta"] == {"note": "round trip", "steps": 3}
    loaded = load_checkpoint(path, device="cpu")
    assert loaded.cfg == model.cfg
    assert not loaded.training
    ids = random_ids(MICRO, 2, 10)
    assert torch.equal(loaded(ids), model(ids))


def test_shipped_checkpoint_is_the_tiny_preset_and_speaks_like_the_corpus():
    model = shipped()
    assert model.cfg == PRESETS["tiny"]
    assert torch.load(DEFAULT_CHECKPOINT, weights_only=True)["config"]["vocab_size"] == len(ALPHABET)
    corpus = make_corpus()
    vocabulary = set(re.findall(r"[A-Za-z]+", corpus))
    tok = CharTokenizer()
    prompt = "The fox"
    out = generate_nocache(model, tok.encode_tensor(prompt), 50)
    text = tok.decode(out.ids[0])
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8
    assert all(w in vocabulary for w in words[:-1]), text  # the last word may be cut off
    assert any(v.startswith(words[-1]) for v in vocabulary), text
    # A model that learned the corpus is far better than chance at predicting it.
    ids = tok.encode_tensor(corpus[:64])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    assert loss < 0.5 * math.log(model.cfg.vocab_size), loss


def test_shipped_draft_is_the_draft_config_and_learned_the_corpus():
    from labcode.config import DRAFT_CONFIG
    from labcode.weights.checkpoint import DRAFT_CHECKPOINT

    draft = load_checkpoint(DRAFT_CHECKPOINT, device="cpu")
    assert draft.cfg == DRAFT_CONFIG and draft.cfg.vocab_size == PRESETS["tiny"].vocab_size
    assert draft.num_params() < shipped().num_params() / 4
    ids = CharTokenizer().encode_tensor(make_corpus()[:64])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(draft(ids[:, :-1])[0], ids[0, 1:]).item()
    assert loss < 0.5 * math.log(draft.cfg.vocab_size), loss


# -- generation and sampling ---------------------------------------------------------------------


def sample_text(seed: int) -> torch.Tensor:
    model, tok = shipped(), CharTokenizer()
    gen = torch.Generator().manual_seed(seed)
    return generate_nocache(model, tok.encode_tensor("The "), 30, temperature=1.0, top_k=20, top_p=0.95,
                            generator=gen).ids


def test_generation_is_reproducible_with_the_same_generator_seed():
    assert torch.equal(sample_text(11), sample_text(11))
    assert not torch.equal(sample_text(11), sample_text(12))


def test_greedy_generation_needs_no_generator_and_is_deterministic():
    model, ids = shipped(), CharTokenizer().encode_tensor("The owl")
    a, b = generate_nocache(model, ids, 12), generate_nocache(model, ids, 12)
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.ids[:, : ids.shape[1]], ids)


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {1, 2}  # top-2 keeps exactly the two largest logits, and both get drawn
    draws = {int(sample_next(logits, 1.0, top_p=1e-6, generator=gen)) for _ in range(20)}
    assert draws == {1}  # a vanishing nucleus keeps only the most likely token
    assert int(sample_next(logits, 0.0)) == 1  # greedy
    assert int(sample_next(logits, 5.0, top_k=1, generator=gen)) == 1


def drawn(logits: torch.Tensor, temperature: float, top_p: float, rows: int = 4000) -> set[int]:
    """The tokens drawn from `rows` copies of one logit row: with this many, every kept token shows up."""
    gen = torch.Generator().manual_seed(0)
    return set(sample_next(logits.expand(rows, -1), temperature, top_p=top_p, generator=gen).tolist())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_p_keeps_the_smallest_prefix_whose_tempered_mass_reaches_top_p(temperature):
    """Token i (by falling probability) is kept when the mass of the tokens before it is at most top_p; the mass
    is that of the tempered distribution, p^(1/T) renormalised. Each cut is tested 0.02 either side."""
    p = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}  # token id -> probability, ids not in probability order
    logits = torch.tensor([[math.log(p[i]) for i in range(4)]])
    tempered = {i: pi ** (1 / temperature) for i, pi in p.items()}
    tempered = {i: w / sum(tempered.values()) for i, w in tempered.items()}
    order = [2, 0, 3, 1]
    before = [sum(tempered[j] for j in order[:n]) for n in range(4)]  # mass ahead of each token in order
    if temperature == 1.0:
        assert before == pytest.approx([0.0, 0.5, 0.8, 0.95])
    else:  # hotter: flatter, so each cut comes earlier (0.379, 0.673, 0.880) and the nucleus is larger
        assert before[1:] == pytest.approx([0.3790, 0.6726, 0.8802], abs=1e-4)
    for n in range(1, 4):
        for top_p in (before[n] - 0.02, before[n] + 0.02):
            assert drawn(logits, temperature, top_p) == set(order[: n + (top_p > before[n])]), (n, top_p)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"temperature": 1.0, "generator": None}, "generator"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_k": -3}, "top_k"),
        ({"temperature": 0.0, "top_k": 0}, "top_k"),  # rejected even when greedy would ignore it
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 0.0, "top_p": -0.1}, "top_p"),
    ],
)
def test_sampling_rejects_bad_arguments(kwargs, argument):
    kwargs = {"generator": torch.Generator().manual_seed(0), **kwargs}
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        sample_next(torch.zeros(1, 8), **kwargs)


def test_sampling_rejects_wrong_logits_rank():
    with pytest.raises(ValueError, match=r"logits: expected rank 2 \[B, V\], got shape \(8,\)"):
        sample_next(torch.zeros(8))


# -- errors on bad ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids,pattern",
    [
        (torch.tensor([[1, 2, 64]]), r"ids: expected values in \[0, 64\), got min 1, max 64"),
        (torch.tensor([[3, -1, 2]]), r"ids: expected values in \[0, 64\), got min -1, max 3"),
        (torch.zeros(1, 0, dtype=torch.long), r"ids: expected at least one token .*got \(1, 0\)"),
        (torch.zeros(0, 4, dtype=torch.long), r"ids: expected at least one token .*got \(0, 4\)"),
        (torch.tensor([1, 2, 3]), r"ids: expected rank 2 \[B, T\], got shape \(3,\)"),
        (torch.zeros(1, 2, 3, dtype=torch.long), r"ids: expected rank 2 \[B, T\], got shape \(1, 2, 3\)"),
        (torch.tensor([[1.0, 2.0]]), r"ids: expected an integer tensor, got torch.float32"),
        (torch.tensor([[True, False]]), r"ids: expected an integer tensor, got torch.bool"),
        ([[1, 2]], r"ids: expected an integer tensor, got <class 'list'>"),
        (torch.zeros(1, 17, dtype=torch.long), r"positions: expected start \+ T <= context_length 16, got .* = 17"),
    ],
    ids=["too-large", "negative", "empty-T", "empty-B", "rank-1", "rank-3", "float", "bool", "list", "too-long"],
)
def test_bad_ids_raise_a_clear_error(ids, pattern):
    with pytest.raises(ValueError, match=pattern):
        micro_model()(ids)


def test_int32_ids_are_accepted_and_match_int64():
    ids = random_ids(MICRO, 1, 6)
    assert torch.equal(micro_model()(ids), micro_model()(ids.to(torch.int32)))


def test_a_full_context_is_accepted():
    assert micro_model()(random_ids(MICRO, 1, MICRO.context_length)).shape[1] == MICRO.context_length


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"context_length": -1}, "context_length"),
        ({"n_layers": 0}, "n_layers"),
        ({"d_model": 0}, "d_model"),
        ({"n_heads": 0}, "n_heads"),
        ({"n_heads": 3}, "n_heads"),  # 64 is not divisible by 3
        ({"n_kv_heads": 3}, "n_kv_heads"),  # 4 query heads cannot share 3 K/V heads
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"rope_base": 0.0}, "rope_base"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_config_rejects_bad_fields(changes, field):
    value = next(iter(changes.values()))
    with pytest.raises(ValueError, match=rf"^GPTConfig\.{field}: expected .*, got {re.escape(repr(value))}$"):
        GPTConfig(**changes)


def test_config_rejects_an_odd_rotary_head_dim():
    with pytest.raises(ValueError, match=r"GPTConfig\.d_model: expected an even head dim .*, got head dim 3"):
        GPTConfig(d_model=12, n_heads=4, rotary=True)


def test_config_is_frozen_and_presets_are_valid():
    cfg = get_config("tiny")
    with pytest.raises(AttributeError):
        cfg.n_layers = 3
    assert cfg.n_kv_heads == cfg.n_heads and cfg.head_dim == cfg.d_model // cfg.n_heads
    assert get_config("tiny", n_layers=3).n_layers == 3 and cfg.n_layers == 2
    with pytest.raises(KeyError, match="preset: expected one of"):
        get_config("huge")


def test_changing_the_head_count_keeps_plain_multi_head_attention():
    cfg = get_config("tiny", n_heads=8)
    assert cfg.n_kv_heads == 8  # not the preset's resolved 4, which would silently become GQA
    assert get_config("tiny", n_heads=2).n_kv_heads == 2
    gqa = GPTConfig(n_heads=4, n_kv_heads=2)
    assert gqa.with_(n_heads=8).n_kv_heads == 2  # an explicit grouping is kept


# -- grouped-query attention and rotary ---------------------------------------------------------------


def test_gqa_has_a_smaller_kv_projection_and_equals_mha_with_repeated_kv_heads():
    gqa = build(MICRO.with_(n_heads=4, n_kv_heads=2), seed=5)
    mha = build(MICRO.with_(n_heads=4), seed=6)
    d, c = gqa.cfg.head_dim, gqa.cfg.d_model
    assert gqa.blocks[0].attn.kv_proj.weight.shape == (2 * 2 * d, c)
    assert mha.blocks[0].attn.kv_proj.weight.shape == (2 * 4 * d, c)
    assert gqa.num_params() < mha.num_params()
    # Copy every weight, expanding each K/V head to the query heads of its group (head h reads h // 2).
    state = {}
    for name, p in gqa.state_dict().items():
        if name.endswith("kv_proj.weight") or name.endswith("kv_proj.bias"):
            p = p.view(2, 2, d, *p.shape[1:]).repeat_interleave(2, dim=1).reshape(2 * 4 * d, *p.shape[1:])
        state[name] = p
    mha.load_state_dict(state)
    ids = random_ids(MICRO, 2, 12)
    assert max_diff(gqa(ids), mha(ids)) <= F64_TOL


def test_rotary_variant_has_no_position_table_and_runs():
    model = micro_model(rotary=True)
    assert model.pos_emb is None
    logits = model(random_ids(MICRO, 2, MICRO.context_length))
    assert logits.shape == (2, MICRO.context_length, MICRO.vocab_size) and torch.isfinite(logits).all()


# -- dropout ------------------------------------------------------------------------------------------


def test_dropout_acts_only_in_train_mode():
    model = build(MICRO.with_(dropout=0.2), seed=2)
    ids = random_ids(MICRO, 1, 10)
    assert torch.equal(model(ids), model(ids))  # eval mode: dropout is off
    reference = build(MICRO, seed=2)
    assert max_diff(model(ids), reference(ids)) == 0.0
    model.train()
    assert max_diff(model(ids), model(ids)) > 1e-3


# -- training ---------------------------------------------------------------------------------------------


def state_equal(a: GPT, b: GPT) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_training_is_deterministic():
    cfg = get_config("tiny")
    (m1, l1), (m2, l2) = train(cfg, steps=3), train(cfg, steps=3)
    assert l1 == l2 and state_equal(m1, m2)
    assert l1[-1] < l1[0]  # it does learn
    m3, _ = train(cfg, steps=3, seed=1)
    assert not state_equal(m1, m3)


def test_training_with_dropout_is_deterministic_and_leaves_the_global_rng_alone():
    cfg = MICRO.with_(dropout=0.1)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    (m1, l1), (m2, l2) = train(cfg, steps=3, batch_size=4), train(cfg, steps=3, batch_size=4)
    assert l1 == l2 and state_equal(m1, m2)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads


# -- corpus and tokenizer ------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_fully_encodable():
    tok = CharTokenizer()
    corpus = make_corpus()
    assert corpus == make_corpus()
    assert corpus != make_corpus(seed=1)
    assert make_corpus(5, seed=3) == make_corpus(5, seed=3)
    ids = tok.encode(corpus)
    assert len(ids) == len(corpus) and tok.decode(ids) == corpus
    assert set(corpus) <= set(ALPHABET)
    assert corpus.count("\n\n") == 600 - 1


def test_tokenizer_round_trip():
    tok = CharTokenizer()
    assert tok.vocab_size == len(ALPHABET) == 64
    assert tok.encode(ALPHABET) == list(range(64))
    text = "The sleepy owl: 'Where?' (yes) - no; fine!\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode_tensor(text)[0]) == text
    assert tok.encode_tensor(text).shape == (1, len(text)) and tok.encode_tensor(text).dtype == torch.long


def test_tokenizer_rejects_unknown_characters_and_ids():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"text: expected characters of the alphabet only, got 'é'"):
        tok.encode("café")
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 64\), got -1"):
        tok.decode([3, -1])
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 64\), got 64"):
        tok.decode(torch.tensor([64]))
