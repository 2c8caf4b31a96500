"""The diagrams of chapters 5 and 9 (`labcode.diagrams`) show the caches' real state: views copy it, drawings
show it."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # draw off screen, whatever MPLBACKEND says

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.patches import FancyArrowPatch, Polygon

from labcode.caches import CacheError, ConcatCache, GrowableCache, RingCache, WindowCache
from labcode.diagrams import (
    buffer_history,
    buffers_figure,
    cells_view,
    draw_buffers,
    draw_cells,
    draw_paged,
    paged_view,
)
from labcode.engines import BlockPool, CellsCache, PagedCache


def feed(cache, n: int) -> None:
    kv = torch.zeros(1, 1, n, 2, dtype=torch.float64)
    cache.feed(kv, kv)


@pytest.fixture
def forked():
    """Sequence a of 6 positions in blocks of 4, forked into b, and each one position longer."""
    pool = BlockPool(1, n_blocks=8, block_size=4)
    a = PagedCache(pool)
    feed(a, 6)
    b = a.fork()
    feed(a, 1)  # a writes into the shared partial block first: it gets a copy
    feed(b, 1)
    return a, b


def texts_of(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_paged_view_copies_tables_counts_and_text(forked):
    a, b = forked
    view = paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"})
    assert view.tables == {"a": (0, 2), "b": (0, 1)} and view.refcount[:3] == (2, 1, 1)
    feed(a, 1)
    assert view.tables["a"] == (0, 2)  # a copy of that moment, not a live reference


def test_draw_paged_shows_every_table_entry_block_and_character(forked):
    a, b = forked
    fig, ax = plt.subplots()
    draw_paged(ax, paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"}), title="t")
    texts = texts_of(ax)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 4  # one per block-table entry
    assert "#0 ref 2" in texts and "#2 ref 1" in texts and "#3 free" in texts  # up to one past the last used
    assert texts.count("→ #0") == 2 and "→ #2" in texts and "→ #1" in texts
    assert texts.count("!") == 2 and texts.count("l") == 2 and texts.count("␣") == 3  # b's block; a's; block 0 thrice
    plt.close(fig)


def test_paged_view_rejects_what_it_cannot_draw(forked):
    a, b = forked
    stranger = PagedCache(BlockPool(1, 4, 4))
    with pytest.raises(CacheError, match=r"caches: expected sequences of one BlockPool, got 2 pools"):
        paged_view({"a": a, "x": stranger}, {"a": "The owl", "x": ""})
    with pytest.raises(CacheError, match=r"texts: expected 7 characters for sequence 'b', got 3"):
        paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The"})
    with pytest.raises(CacheError, match=r"caches: expected a dict of one or two PagedCaches"):
        paged_view({"a": a, "b": b, "c": a}, {"a": "The owl", "b": "The ow!", "c": "The owl"})


def test_cells_view_and_drawing_show_owners_positions_and_head():
    cache = CellsCache(1, 8, n_seqs=3)
    cache.plan([0, 0, 1, 1, 1])
    feed(cache, 5)
    cache.seq_rm(1, 0, 1)  # frees cell 2 (sequence 1's position 0): the head moves back to it
    cache.seq_cp(0, 2, 0, 1)  # cell 0 now has two owners
    view = cells_view(cache, names="ABC")
    assert view.pos == (0, 1, -1, 1, 2, -1, -1, -1) and view.owners[:5] == ("AC", "A", "", "B", "B")
    assert view.head == 2
    fig, ax = plt.subplots()
    draw_cells(ax, view, title="t", per_row=4)
    texts = texts_of(ax)
    assert [t for t in texts if t.isdigit() and len(t) == 1][:3] == ["0", "0", "1"]  # row label 0, cells 0 and 1
    assert texts.count("·") == 4 and "head" in texts and "4" in texts  # empty cells; head; the second row's label
    assert len([p for p in ax.patches if isinstance(p, Polygon)]) == 1
    stripes = [p for p in ax.patches if p.get_alpha() == 0.45]
    assert len(stripes) == 5  # one per owner: two in cell 0, one each in cells 1, 3 and 4
    plt.close(fig)
    with pytest.raises(CacheError, match=r"names: expected one character for each of the 3 sequences, got AB"):
        cells_view(cache, names="AB")
    with pytest.raises(CacheError, match=r"cache: expected a CellsCache, got PagedCache"):
        cells_view(PagedCache(BlockPool(1, 2, 2)))


# -- chapter 5: one layer's key buffer after each pass ------------------------------------------------

CHUNKS = (3, 1, 2, 1, 4)


def test_buffer_history_of_the_window_shows_the_shift_and_the_drops():
    rows = buffer_history(WindowCache(1, 4), CHUNKS)
    assert [r.slots for r in rows] == [(0, 1, 2, None), (0, 1, 2, 3), (2, 3, 4, 5), (3, 4, 5, 6), (7, 8, 9, 10)]
    assert [r.new for r in rows] == [(0, 1, 2), (3,), (2, 3), (3,), (0, 1, 2, 3)]
    assert [r.copied for r in rows] == [(), (), (0, 1), (0, 1, 2), ()]  # the kept rows moved to the front
    assert [r.rows_copied for r in rows] == [0, 0, 2, 3, 0]
    assert [r.dropped for r in rows] == [0, 0, 2, 1, 4]


def test_buffer_history_of_concat_and_growable_shows_every_copy():
    concat = buffer_history(ConcatCache(1), CHUNKS)
    assert concat[-1].slots == tuple(range(11))
    assert [len(r.copied) for r in concat] == [r.rows_copied for r in concat] == [0, 3, 4, 6, 7]  # all old rows
    grow = buffer_history(GrowableCache(1, 4), CHUNKS)
    assert [len(r.slots) for r in grow] == [4, 4, 8, 8, 12]  # linear growth by the first capacity
    assert [len(r.copied) for r in grow] == [0, 0, 4, 0, 7]
    assert [r.rows_copied for r in grow] == [0, 0, 4, 0, 8]  # a growth copies the empty slot too
    assert grow[-1].slots[-1] is None


def test_buffer_history_of_a_ring_moves_nothing():
    rows = buffer_history(RingCache(1, 4), CHUNKS)
    assert all(r.copied == () and r.rows_copied == 0 for r in rows)
    assert sorted(p for p in rows[-1].slots if p is not None) == [7, 8, 9, 10]


def test_buffer_history_refuses_a_used_cache_and_a_miscounted_copy():
    used = WindowCache(1, 4)
    used.feed(torch.zeros(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64))
    with pytest.raises(CacheError, match="cache: expected a new cache of one layer"):
        buffer_history(used, CHUNKS)
    with pytest.raises(CacheError, match="cache: expected a new cache of one layer"):
        buffer_history(WindowCache(2, 4), CHUNKS)

    class Uncounted(WindowCache):  # a shift that forgets to count what it moves
        def _shift(self, layer, drop):
            before = self.rows_copied
            super()._shift(layer, drop)
            self.rows_copied = before

    with pytest.raises(CacheError, match="rows_copied to count the 2 old rows it copied"):
        buffer_history(Uncounted(1, 4), CHUNKS)


def test_draw_buffers_shows_every_position_and_what_each_pass_did():
    rows = buffer_history(WindowCache(1, 4), CHUNKS)
    fig, ax = plt.subplots()
    draw_buffers(ax, rows, "W = 4")
    texts = texts_of(ax)
    assert "W = 4" in texts and [f"+{t}" for t in CHUNKS] == [t for t in texts if t.startswith("+")]
    assert {str(p) for p in range(11)} <= set(texts)
    assert "copied 2, dropped 2" in texts and "dropped 4" in texts
    plt.close(fig)
    fig = buffers_figure({"a": rows, "b": buffer_history(ConcatCache(1), CHUNKS)})
    assert len(fig.axes) == 2 and fig.axes[0].get_legend() is not None
    plt.close(fig)
    with pytest.raises(CacheError, match="histories: expected a dict"):
        buffers_figure({})


def test_diagrams_small_print_is_legible_at_natural_size(forked):
    """A diagram keeps its natural size on a phone, so its smallest print is LABEL_FONT (about 12 px on the
    page at labcode.plotting.PAGE_DPI), block ids and reference counts included."""
    from labcode.diagrams import LABEL_FONT, cells_legend
    from labcode.plotting import PAGE_DPI, drawn_texts

    a, b = forked
    cells = CellsCache(1, 8, n_seqs=2)
    cells.plan([0, 0, 1])
    feed(cells, 3)
    histories = {"ConcatCache": buffer_history(ConcatCache(1), [3, 1])}
    fig, (paged, cell) = plt.subplots(2, 1)
    draw_paged(paged, paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"}), title="t")
    draw_cells(cell, cells_view(cells), title="t")
    cells_legend(cell, "AB")
    for drawn in (fig, buffers_figure(histories)):
        drawn.canvas.draw()
        sizes = [t.get_fontsize() for t in drawn_texts(drawn)]
        assert sizes and min(sizes) >= LABEL_FONT, sorted(sizes)[:3]
        plt.close(drawn)
    assert LABEL_FONT * PAGE_DPI / 72 >= 12


# -- chapter 8: one query row's walk through the keys, block by block ------------------------------------------

def _walk_inputs(h=4, hkv=2, s=30, d=8, t=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, m, d, generator=g, dtype=torch.float64) for n, m in ((h, t), (hkv, s), (hkv, s))]


def test_online_walk_holds_the_recurrences_running_state_after_each_block():
    import math

    from labcode.attention import online_softmax_attention
    from labcode.diagrams import online_walk

    q, k, v = _walk_inputs()
    walk = online_walk(q, k, v, block_size=8, head=3)  # head 3 reads key/value head 1; the last block is shorter
    scores = (k[0, 1] @ q[0, 3, 0] / math.sqrt(8)).tolist()
    assert walk.scores == pytest.approx(scores, abs=1e-12) and len(walk.running_max) == 4
    m, ssum = float("-inf"), 0.0
    for b, j in enumerate(range(0, 30, 8)):  # the recurrence, one block at a time, in plain Python
        m_new = max(m, *scores[j : j + 8])
        rescale = math.exp(m - m_new)
        ssum = ssum * rescale + sum(math.exp(x - m_new) for x in scores[j : j + 8])
        m = m_new
        assert walk.running_max[b] == pytest.approx(m, abs=1e-12)
        assert walk.rescale[b] == pytest.approx(rescale, abs=1e-12)
        assert walk.running_sum[b] == pytest.approx(ssum, rel=1e-12)
    assert walk.rescale[0] == 0.0
    out = online_softmax_attention(q, k, v, block_size=8)[0, 3, 0]
    weights = torch.tensor([math.exp(x - m) / ssum for x in scores], dtype=torch.float64)
    assert torch.allclose(out, weights @ v[0, 1], atol=1e-12, rtol=0)


def test_online_walk_rejects_what_it_cannot_draw():
    from labcode.diagrams import online_walk

    q, k, v = _walk_inputs()
    with pytest.raises(ValueError, match=r"q: expected one decode step, \[1, H, 1, D\], got \(1, 4, 2, 8\)"):
        online_walk(*_walk_inputs(t=2), block_size=8)
    with pytest.raises(ValueError, match="block_size: expected a positive int, got 0"):
        online_walk(q, k, v, block_size=0)
    with pytest.raises(ValueError, match=r"head: expected a query head in \[0, 4\), got 4"):
        online_walk(q, k, v, block_size=8, head=4)
    with pytest.raises(ValueError, match="k, v: expected two"):
        online_walk(q, k[..., :4], v, block_size=8)


def test_walk_figure_draws_every_block_key_and_state_legibly():
    from matplotlib.patches import Rectangle

    from labcode.diagrams import online_walk, walk_figure
    from labcode.plotting import MIN_TEXT_PT, drawn_texts

    walk = online_walk(*_walk_inputs(), block_size=8)
    fig = walk_figure(walk)
    ax = fig.axes[0]
    texts = texts_of(ax)
    assert {"keys of K, V", "0–7", "8–15", "16–23", "24–29"} <= set(texts)  # the last block is shorter
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_alpha() == 0.85]
    assert len(bars) == 30  # one per key
    for values in (walk.running_max, walk.rescale, walk.running_sum):
        assert all(f"{x:.2f}" in texts for x in values)
    fig.canvas.draw()
    assert min(t.get_fontsize() for t in drawn_texts(fig)) >= MIN_TEXT_PT  # it shrinks on a phone with the page
    plt.close(fig)


# -- the pictures that open chapters 1 to 4, 10 and 11: drawn from real runs of the tiny model ------------------

@pytest.fixture(scope="module")
def tiny():
    from labcode.weights.checkpoint import load_checkpoint

    return load_checkpoint(device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def tok():
    from labcode.tokenizer import CharTokenizer

    return CharTokenizer()


def _phone_px(fig) -> float:
    """The picture's smallest text in CSS px on a 390 px phone, where the page shrinks it to the 358 px column."""
    import base64
    import io

    from PIL import Image

    from labcode.plotting import PNG_TEXT_KEY, page_png

    png, meta = page_png(fig)  # as the book shows it: its PNG records its smallest text at its natural width
    record = float(Image.open(io.BytesIO(base64.b64decode(png))).text[PNG_TEXT_KEY])
    return record * min(1.0, 358 / meta["width"])


def test_calls_view_shows_what_each_call_ran_and_chose(tiny, tok):
    from labcode.diagrams import calls_figure, calls_view, generation_calls
    from labcode.generate import generate, generate_nocache

    prompt = tok.encode_tensor("The fox")
    plain, cached = generate_nocache(tiny, prompt, 3), generate(tiny, prompt, 3, ConcatCache(2))
    a, b = calls_view(plain, 7, tok.decode), calls_view(cached, 7, tok.decode)
    text = tok.decode(plain.ids[0].tolist())
    assert a.texts == b.texts == (text[:7], text[:8], text[:9]) and a.chosen == tuple(text[7:10])
    assert a.ran == (7, 8, 9) and b.ran == (7, 1, 1)
    assert generation_calls(tiny, prompt, 3, tok.decode) == {"without a cache": a, "with a cache": b}
    fig = calls_figure({"no cache": a, "cache": b})
    texts = texts_of(fig.axes[0])
    assert [t for t in texts if t.startswith("ran ")] == ["ran 7", "ran 8", "ran 9", "ran 7", "ran 1", "ran 1"]
    filled = [p for p in fig.axes[0].patches if p.get_facecolor()[3] > 0 and p.get_alpha() == 0.35]
    assert len(filled) == 7 + 8 + 9 + 7 + 1 + 1  # one filled box per position run
    assert _phone_px(fig) >= 9.5
    plt.close(fig)
    with pytest.raises(ValueError, match=r"calls: expected an int in \[1, 3\], got 4"):
        calls_view(plain, 7, tok.decode, calls=4)
    with pytest.raises(ValueError, match=r"generation: expected call 0 to run 1 to 6 positions, got 7"):
        calls_view(plain, 6, tok.decode)  # the wrong prompt length: the record cannot be read


def test_scores_view_takes_the_models_own_weights_and_sees_the_old_rows_unchanged(tiny, tok):
    from labcode.diagrams import scores_figure, scores_view

    view = scores_view(tiny, tok.encode_tensor("The owl."), tok.decode, layer=1, head=2)
    w = torch.tensor(view.weights)
    assert w.shape == (8, 8) and torch.allclose(w.sum(-1), torch.ones(8, dtype=w.dtype), atol=1e-12)
    assert (w.triu(1) == 0).all() and view.old_rows_unchanged and view.text == "The owl."
    fig = scores_figure(view)
    assert "← the new row" in texts_of(fig.axes[0]) and "the same as" in texts_of(fig.axes[0])
    assert _phone_px(fig) >= 9.5
    plt.close(fig)
    import copy

    noisy = copy.deepcopy(tiny)
    noisy.blocks[0].attn.cfg = noisy.cfg.with_(dropout=0.5)  # dropout on the weights: not softmax(q k) any more
    noisy.train()
    with pytest.raises(CacheError, match="model: expected head 0's output to be its weights times its values"):
        scores_view(noisy, tok.encode_tensor("The owl."), tok.decode)


def test_module_state_history_shows_every_cat_copy_and_resets_the_model(tiny, tok):
    from labcode.diagrams import module_state_history, states_figure

    ids = tok.encode_tensor("The little fox")
    panels = module_state_history(tiny, ids, [(0, 6), (6, 1), (7, 3)], tok.decode)
    assert tiny.current_pos == 0 and tiny.blocks[0].attn.cache_k is None  # the model is left as it was found
    rows = [p.rows[1] for p in panels]
    assert [r.text for r in rows] == ["The li", "The lit", "The little"]
    assert [(r.new, r.copied, r.note) for r in rows] == [(6, 0, "ptr 6"), (1, 6, "ptr 7"), (3, 7, "ptr 10")]
    assert panels[2].note == "current_pos 10" and panels[1].title == "model(ids[6:7], use_cache=True)"
    fig = states_figure(panels)
    assert _phone_px(fig) >= 9.5
    plt.close(fig)
    with torch.no_grad():
        tiny(ids[:, :2], use_cache=True)
    try:
        with pytest.raises(ValueError, match="model: expected a model holding no naive cache"):
            module_state_history(tiny, ids, [(0, 2)], tok.decode)
    finally:
        tiny.reset_kv_cache()


def test_pairs_fork_view_shows_two_continuations_of_one_untouched_list(tiny, tok):
    from labcode.diagrams import pairs_fork_view, states_figure

    panels = pairs_fork_view(tiny, tok.encode_tensor("The hare"),
                             {"a": tok.encode_tensor(" ran"), "b": tok.encode_tensor("s")}, tok.decode)
    assert [p.rows[0].text for p in panels] == ["The hare", "The hare ran", "The hares"]
    assert [(p.rows[1].new, p.rows[1].copied) for p in panels] == [(8, 0), (4, 8), (1, 8)]
    assert panels[2].title == "b = model('s', caches, ...)" and len(panels[0].rows) == tiny.cfg.n_layers
    fig = states_figure(panels, footer="f")
    assert "f" in texts_of(fig.axes[0]) and _phone_px(fig) >= 9.5
    plt.close(fig)


def test_split_views_count_each_processs_bytes_from_the_cache(tiny, tok):
    from labcode.diagrams import split_views, splits_figure
    from labcode.distributed.tensor_parallel import tp_cache_bytes
    from labcode.generate import prefill

    cache = ConcatCache(2)
    with torch.no_grad():
        prefill(tiny, tok.encode_tensor("The sleepy fox"), cache)
    heads, layers, shipped = split_views(tiny, cache)
    assert heads.holders == (("0", "0", "1", "1"),) * 2 and layers.holders == (("0",) * 4, ("1",) * 4)
    half = tp_cache_bytes(2, 1, 14, 4, tiny.cfg.head_dim, 8, 2)
    assert 2 * half == cache.nbytes and heads.notes == layers.notes == (f"{half:,} B each",)
    assert shipped.notes[0].endswith(" B sent") and int(shipped.notes[0].split()[0].replace(",", "")) > cache.nbytes
    fig = splits_figure([heads, layers, shipped])
    assert texts_of(fig.axes[0]).count("1") == 4 + 4 + 8 and _phone_px(fig) >= 9.5
    plt.close(fig)
    with pytest.raises(CacheError, match="cache: expected a filled ConcatCache"):
        split_views(tiny, ConcatCache(2))


def test_serve_views_show_each_pass_and_the_blocks_each_request_holds(tiny):
    from labcode.diagrams import pool_figure, serve_views
    from labcode.serving import Scheduler, random_trace

    trace = random_trace(0, 10, tiny.cfg.vocab_size, prompt_len=(4, 14), max_new=(3, 8), last_arrival=6)
    sched = Scheduler(tiny, 10, 4, 8, prefix="hash")
    for req in trace:
        sched.submit(req)
    views = serve_views(sched, [3, 4])
    assert [v.step for v in views] == [3, 4] and not sched.busy()
    for v in views:
        assert sum(n for _, n, _ in v.batch) <= v.budget == 8 and len(v.blocks) == 10
        for rid, _, _ in v.batch:  # every request of a pass holds blocks enough for what it has computed
            assert any(rid in names.split() for names, _, _ in v.blocks) or rid in sched.done
    held = [names for names, _, _ in views[1].blocks if names]
    assert all(0 < f <= 4 for names, f, _ in views[1].blocks if names) and len(held) >= 3
    assert any(decode for _, _, decode in views[1].batch) and any(not d for _, _, d in views[1].batch)
    fig = pool_figure(views)
    assert "step 4: one pass, 8 tokens at most" in texts_of(fig.axes[0]) and _phone_px(fig) >= 9.5
    plt.close(fig)
    again = Scheduler(tiny, 10, 4, 8)
    for req in trace:
        again.submit(req)
    with pytest.raises(CacheError, match=r"steps: expected steps the scheduler ran"):
        serve_views(again, [999])


def test_three_answers_view_reads_the_positions_from_the_caches():
    from labcode.diagrams import three_answers_figure, three_answers_view
    from labcode.tokenizer import CharTokenizer
    from labcode.weights.checkpoint import load_checkpoint

    model, text = load_checkpoint(device="cpu", dtype=torch.float64), "The owl"
    ids = CharTokenizer().encode_tensor(text)
    rows = three_answers_view(model, ids, 3, text)
    assert [p for _, p, on in rows["full model"] if on] == list(range(7))
    assert [p for _, p, on in rows["window cache"] if on] == [4, 5, 6]  # the latest three, at their positions
    assert [(c, p) for c, p, _ in rows["truncated recompute"]] == [("o", 0), ("w", 1), ("l", 2)]  # renumbered
    assert rows["window cache"][3][0] == "␣"
    plt.close(three_answers_figure(rows, [None, "a", "b"]))
    with pytest.raises(CacheError, match=r"window: expected fewer slots"):
        three_answers_view(model, ids, 7, text)


def test_row_bytes_are_what_the_real_caches_hold():
    """Chapter 13's opening picture: each lever's bytes per token, from the formulas, equal what a real cache of
    that kind holds after a pass of `tokens` (float64 elements; chapter 9's int8 keeps float32 scales)."""
    from labcode import GPT, GPTConfig
    from labcode.caches import LatentCache, StreamingCache
    from labcode.diagrams import row_bytes, row_bytes_figure
    from labcode.engines import KIVICache, QuantizedCache

    cfg = GPTConfig(vocab_size=13, context_length=40, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32, rotary=True)
    tokens = 30
    ids = torch.randint(0, 13, (1, tokens), generator=torch.Generator().manual_seed(0))

    def held(c, cache) -> float:  # bytes per token that `cache` holds after the pass
        torch.manual_seed(0)
        with torch.no_grad():
            GPT(c).double().eval()(ids, cache)
        return cache.nbytes / tokens

    rows = row_bytes(cfg, tokens, rank=8, rope_dim=4, bits=2, group_size=4, residual=6, budget=8, share_every=2,
                     element_bytes=8)
    got = {r.label.split(":")[0]: r for r in rows}
    assert [r.total for r in rows[:3]] == [held(cfg.with_(n_kv_heads=h), ConcatCache(3)) for h in (4, 2, 1)]
    assert got["MLA"].total == held(cfg.with_(n_kv_heads=None, kv_latent=8, latent_rope_dim=4), LatentCache(3))
    assert rows[4].total == held(cfg, QuantizedCache(3, bits=8))
    kivi = KIVICache(3, bits=2, group_size=4, residual=6)
    assert rows[5].total == held(cfg, kivi) and kivi.quantized() == 24  # 4 groups of 4 older than the latest 6
    assert dict(rows[5].parts)["K and V"] == sum(s[n].nbytes for s in kivi.store for n in ("k_res", "v_res")) / tokens
    assert rows[6].total == held(cfg, StreamingCache(3, budget=8))
    assert rows[7].total == held(cfg.with_(n_layers=2), ConcatCache(2))  # layers 0 and 2 own their K/V
    fig = row_bytes_figure(rows)
    assert f"{rows[0].total:,.0f} B" in texts_of(fig.axes[0]) and _phone_px(fig) >= 9.5
    plt.close(fig)
    with pytest.raises(CacheError, match=r"expected grouped heads"):
        row_bytes(cfg.with_(n_kv_heads=None), tokens, 8, 4)
