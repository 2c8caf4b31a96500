"""The benchmark suite and the counting formulas of chapter 7.

The suite runs end to end at its smallest sizes and writes a schema-valid result with
plots; its timings are never asserted. The FLOP formulas must equal what
FlopCounterMode measures, exactly, and the cache-bytes formula must equal the bytes
real caches hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from labcode import GPT, get_config
from labcode.bench import SIZES, random_model
from labcode.bench.__main__ import main as bench_main
from labcode.bench.append import AppendSetup, bench_append
from labcode.bench.compiled import _logit_diffs, _ModelStep
from labcode.bench.floor import step_bytes
from labcode.bench.targets import speedup_at_floor
from labcode.caches import ConcatCache, GrowableCache, PairsCache, RingCache, WindowCache
from labcode.cost import kv_cache_bytes, kv_cache_elements
from labcode.flops import (
    attention_flops,
    attention_sum,
    forward_flops,
    generation_flops,
    linear_params,
    linear_sum,
    measure_flops,
)
from labcode.generate import decode_step, generate, generate_nocache

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "qa" / "results.schema.json").read_text())


# -- the suite, end to end -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One run of the command line at the "test" sizes: (result document, written figure paths)."""
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    try:
        assert bench_main(["--test", "--out", str(out / "bench.json"), "--plots", str(out / "plots"),
                           "--no-progress", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "bench.json").read_text()), sorted((out / "plots").glob("*.png"))


def test_result_file_is_schema_valid_and_machine_dependent(bench_run):
    doc, _ = bench_run
    jsonschema.validate(doc, SCHEMA)
    assert doc["name"] == "bench" and doc["machine_dependent"] is True
    assert doc["parameters"]["mode"] == "test"
    assert set(doc["rules"]) == set(doc["values"])
    assert {r["compare"] for r in doc["rules"].values()} == {"recorded"}  # timings are never compared


def test_result_holds_every_measurement(bench_run):
    values = bench_run[0]["values"]
    for key in ("machine", "append", "append_attention", "generation", "targets",
                "elapsed_s", "roofline_machine", "roofline", "roofline_summary", "batch", "floor_ops",
                "window_vs_concat", "memory", "compiled"):
        assert key in values, key
    assert set(values["append"]) == {"candle", "long"}
    for run in values["append"].values():
        assert len(run["cache_length"]) == SIZES["test"].append_decode
        assert set(run["per_step_s"]) == set(run["median_step_s"])
        assert {"cat", "slice", "ring", "grow_linear", "grow_double"} <= set(run["per_step_s"])
    assert {"cat/repeat_kv", "cat/gqa", "cat/sdpa", "slice/repeat_kv", "slice/gqa", "slice/sdpa"} == set(
        values["append_attention"]["median_step_s"])
    for preset, _, new, _ in SIZES["test"].generation:
        run = values["generation"][preset]
        assert set(run["per_step_s"]) >= {"nocache", "cat", "window", "naive", "explicit"}
        assert all(len(ts) == new for ts in run["per_step_s"].values())
        assert run["predicted_speedup"] == run["flops_nocache"] / run["flops_cached"]
    steps = values["compiled"]["runs"]["tiny"]  # the floor's preset: the eager variants beside the fused step
    assert list(steps["variants"]) == ["eager model", "row-major weights", "products only", "lean", "fused eager"]
    assert set(steps["max_logit_diff"]) == set(steps["variants"])  # every step's logits checked
    for v in steps["variants"].values():
        assert len(v["over_floor"]) == len(v["over_floor_cpu"]) == len(steps["positions"]) == len(steps["floor_s"])
    assert steps["kv_bytes_per_key"] == 2 * get_config("tiny").n_layers * get_config("tiny").d_model * 4
    products = {tuple(r["shape"]): r["bytes_per_s"] for r in values["floor_ops"]["products"]}
    assert set(products) == {(256, 64), (64, 256), (64, 64), (128, 64), (192, 64)}  # and the fused Q/K/V weight
    assert all({"F.linear, row", "F.linear, col"} <= set(ways) for ways in products.values())


def test_checks_are_about_correctness_and_pass(bench_run):
    doc, _ = bench_run
    names = {c["name"] for c in doc["checks"]}
    assert {"flops_full_forward", "flops_decode_step", "attention_methods_agree", "memory_allocation",
            "fused_step_float64_window", "fused_step_float64_concat", "decode_step_logits_tiny"} <= names
    assert not any("speed" in n or "floor" in n for n in names), "timings must never be checks"
    assert doc["passed"], [c for c in doc["checks"] if not c["passed"]]


def test_targets_are_reported_not_enforced(bench_run):
    targets = bench_run[0]["values"]["targets"]
    assert {t["name"] for t in targets} >= {"slice_write_flat", "slice_vs_cat_long", "decode_near_floor",
                                            "decode_near_floor_lean", "window_not_slower", "roofline_prediction",
                                            "batch_prediction", "compiled_near_floor_tiny", "compiled_speedup_tiny"}
    for t in targets:
        assert isinstance(t["met"], bool) and isinstance(t["measured"], float)
        assert ("reason" in t) == (not t["met"]), t  # a target not met says why, measured
        assert "reason_if_not_met" not in t
    by_name = {t["name"]: t for t in targets}
    assert by_name["decode_near_floor"]["products_only"] > 0
    floor_preset = SIZES["test"].floor_preset  # only the generation of the floor's preset gets the bound
    assert [n for n, t in by_name.items() if "speedup_at_floor" in t] == [f"speedup_{floor_preset}"]


def test_batch_target_names_each_step_outside_the_tolerance():
    from labcode.bench.targets import targets

    run = {"s_cached": 128, "batch": [1, 4, 16], "ratio": [1.2, 0.6, 1.6], "ratio_cpu": [1.1, 0.7, 1.3],
           "ratio_plain": [1.3, 0.4, 1.6], "overhead_s_per_op": [4e-6, 5e-6, 8e-6],
           "ceilings": [{"768x768": 1.5e10}, {"768x768": 8e9, "3072x768": 9.5e9, "K/V": 1.7e10}, {}],
           "products_flops": [None, None, None], "step_s": [1e-3, 2e-3, 3e-3], "ops_by_batch": [100, 100, 100],
           "predicted": {"bound": ["memory", "memory", "overhead"], "t_parts": [5e-4, 1e-3, 1e-3]}}
    [t] = targets({"batch": {"gpt2-124m": {"runs": [run]}}}, only=("batch_prediction",))
    assert t["measured"] == pytest.approx(1 / 0.6) and t["one_bandwidth"] == pytest.approx(2.5)
    assert t["measured_cpu"] == pytest.approx(1 / 0.7) and (t["points"], t["outside"]) == (3, 2)
    assert not t["met"] and t["claim"].startswith("every decode step of the batch sweep (gpt2-124m) within 1.5x")
    # an overhead-bound step: what its operations took each beyond its bytes and FLOPs, (3 - 1) ms / 100
    assert t["reason"] == ("gpt2-124m B = 4 at S = 128: 0.6x (memory-bound; beside it weights 8-9.5 GB/s, "
                           "K/V 17 GB/s, 5 µs per operation); gpt2-124m B = 16 at S = 128: 1.6x (overhead-bound; "
                           "beside it weights at the bandwidth; its 100 operations took 20 µs each beyond the "
                           "predicted time of its bytes and FLOPs, against 8 µs per operation measured beside it)")
    run["ratio"][1:] = [0.9, 1.4]
    run["products_flops"][2], run["predicted"]["bound"][2] = 4e10, "compute"
    [t] = targets({"batch": {"gpt2-124m": {"runs": [run]}}}, only=("batch_prediction",))
    assert t["met"] and "reason" not in t and t["outside"] == 0
    run["ratio"][2] = 0.5
    [t] = targets({"batch": {"gpt2-124m": {"runs": [run]}}}, only=("batch_prediction",))
    assert t["reason"] == ("gpt2-124m B = 16 at S = 128: 0.5x (compute-bound; beside it compute-bound products "
                           "40 GFLOP/s, 8 µs per operation)")


def test_a_target_is_a_template_over_facts_judged_by_its_comparison():
    from labcode.bench.targets import Target

    t = Target("fast_{preset}", "{preset} at least {target:g}x", ">=", 2.0, "x", "only {x:.2g}x at {preset}",
               lambda values, target: [{"preset": p, "x": x, "extra": 7} for p, x in values.items()], ("extra",))
    met, missed = (t.judge(f) for f in t.facts({"a": 2.0, "b": 1.25}, t.target))
    assert met == {"name": "fast_a", "claim": "a at least 2x", "target": 2.0, "comparison": ">=", "measured": 2.0,
                   "extra": 7, "met": True}
    assert not missed["met"] and missed["reason"] == "only 1.2x at b"


def test_speedup_at_floor_adds_one_floor_per_decode_step():
    run = {"positions": [4, 5, 6], "total_s": {"nocache": 12.0}, "per_step_s": {"window": [1.0, 9.0, 9.0]}}
    steps = {"bandwidth_bytes_per_s": [9.0, 10.0, 11.0], "kv_bytes_per_key": 2, "weight_bytes": 10}
    # decode steps attend to 5 and 6 keys: (10 + 10) / 10 + (10 + 12) / 10 = 4.2 s at the median bandwidth, plus
    # the measured prompt pass
    assert speedup_at_floor(run, steps) == pytest.approx(12.0 / 5.2)


def test_every_figure_is_written(bench_run):
    from labcode.bench.plots import PLOTS

    _, plots = bench_run
    assert set(PLOTS) == {"roofline", "roofline_fit", "rows", "batch", "stream_ceilings", "critical_batch",
                          "concurrency", "floor_ops", "floor_ratio", "window_vs_concat", "overhead_crossover",
                          "latency_throughput", "append_medians", "compiled"}  # the book's figures, each drawn once
    assert [p.name for p in plots] == sorted(f"bench_{n}.png" for n in PLOTS)
    assert all(p.stat().st_size > 5000 for p in plots)


def test_chapter_figures_fit_the_column_and_read_in_dark_mode(bench_run):
    import matplotlib.pyplot as plt

    from labcode.bench.plots import PLOTS
    from labcode.plotting import COLUMN_INCHES, MIN_TEXT_PT, drawn_texts

    values = bench_run[0]["values"]
    for name, draw in PLOTS.items():
        fig = draw(values)
        try:
            fig.canvas.draw()  # tick labels get their text when drawn
            assert fig.get_figwidth() <= COLUMN_INCHES, name
            assert fig.patch.get_alpha() == 0 or fig.get_facecolor()[3] == 0, name  # transparent background
            assert min(t.get_fontsize() for t in drawn_texts(fig)) >= MIN_TEXT_PT, name  # legible on a phone
            labels = [t.get_text() for ax in fig.axes for t in ax.xaxis.get_ticklabels() + ax.yaxis.get_ticklabels()]
            assert labels and not any("$" in t or "^" in t or "×" in t for t in labels), name  # no "2.4x10^0"
            for ax in fig.axes:
                assert len([ln for ln in ax.get_lines() if ln.get_label() and not ln.get_label().startswith("_")]
                           ) <= 6, name  # a handful of labelled series per panel
        finally:
            plt.close(fig)


def test_every_appender_stores_the_same_keys():
    setup = AppendSetup("t", prefill=5, decode=7, n_layers=2, grow_start=2)
    kinds = ["cat", "slice", "ring", "grow_linear", "grow_double", "bare_cat", "bare_slice", "fused_slice"]
    run = bench_append(setup, kinds, rounds=1, device=torch.device("cpu"))
    assert run["max_content_diff"] == 0.0
    assert run["cache_length"] == list(range(6, 13))


# -- FLOPs: formulas against FlopCounterMode -------------------------------------------------------------------------

CONFIGS = {
    "mha": get_config("tiny"),
    "gqa": get_config("tiny", n_kv_heads=2),
    "mqa": get_config("tiny", n_kv_heads=1),
    "rotary": get_config("tiny", rotary=True, n_kv_heads=2),
    "micro": get_config("micro"),
}


def _model(cfg):
    torch.manual_seed(0)
    return GPT(cfg).eval()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("batch,t", [(1, 1), (2, 7), (3, 16)])
def test_full_forward_flops_equal_the_formula(name, batch, t):
    cfg = CONFIGS[name]
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, t))
    with torch.inference_mode():
        measured, per_op = measure_flops(lambda: model(ids))
    assert measured == forward_flops(cfg, t, 0, batch)
    assert per_op["bmm"] == attention_flops(cfg, t, t, batch)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("schedule", [(1, 1, 1, 1), (3, 3), (5, 1, 4)])
def test_cached_chunk_flops_equal_the_formula(name, schedule):
    cfg = CONFIGS[name]
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, sum(schedule)))
    cache, start = ConcatCache(cfg.n_layers), 0
    with torch.inference_mode():
        for t in schedule:
            chunk = ids[:, start : start + t]
            measured, _ = measure_flops(lambda chunk=chunk: model(chunk, cache))
            assert measured == forward_flops(cfg, t, start, 2), (t, start)
            start += t


@pytest.mark.parametrize("cached", [False, True])
def test_generation_flops_equal_the_formula_call_by_call(cached):
    cfg = CONFIGS["gqa"]
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    original, flops_per_call = model.forward, []

    def counted_forward(*args, **kwargs):  # every forward call of the generation loop, counted on its own
        out = []
        total, _ = measure_flops(lambda: out.append(original(*args, **kwargs)))
        flops_per_call.append(total)
        return out[0]

    model.forward = counted_forward
    if cached:
        generate(model, ids, 9, ConcatCache(cfg.n_layers))
    else:
        generate_nocache(model, ids, 9)
    assert flops_per_call == generation_flops(cfg, 5, 9, cached)


@pytest.mark.parametrize("n", [1, 2, 5, 64, 300])
def test_closed_form_sums_equal_the_step_by_step_sums(n):
    cfg = get_config("gpt2-124m")
    unit = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert attention_sum(cfg, n, cached=False) == sum(unit * t * t for t in range(1, n + 1))
    assert attention_sum(cfg, n, cached=True) == sum(unit * t for t in range(1, n + 1))
    assert linear_sum(cfg, n, cached=False) == sum(2 * linear_params(cfg) * t for t in range(1, n + 1))
    assert linear_sum(cfg, n, cached=True) == 2 * linear_params(cfg) * n
    # generation from a one-token prompt without a cache is exactly these sums
    assert sum(generation_flops(cfg, 1, n, cached=False)) == attention_sum(cfg, n, False) + linear_sum(cfg, n, False)


def test_linear_params_counts_the_weight_matrices_of_the_model():
    for cfg in CONFIGS.values():
        model = _model(cfg)
        matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "pos_emb" not in n)
        assert linear_params(cfg) == matrices


# -- bytes -----------------------------------------------------------------------------------------------------------

def test_the_seeds_worked_example_768_elements_6144_bytes():
    cfg = get_config("micro")  # L=2, C=16: the seed's example
    model = _model(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    cache = ConcatCache(cfg.n_layers)
    with torch.inference_mode():
        model(ids, cache)
    assert kv_cache_elements(cfg.n_layers, 2, 6, cfg.n_kv_heads, cfg.head_dim) == 768
    assert kv_cache_bytes(cfg.n_layers, 2, 6, cfg.n_kv_heads, cfg.head_dim, 8) == 6144 == cache.nbytes


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cache_bytes_formula_equals_real_caches(name, dtype):
    cfg = CONFIGS[name]
    model = _model(cfg).to(dtype)
    b, t = 3, 10
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    expected = kv_cache_bytes(cfg.n_layers, b, t, cfg.n_kv_heads, cfg.head_dim, torch.finfo(dtype).bits // 8)
    caches = [ConcatCache(cfg.n_layers), WindowCache(cfg.n_layers, t), RingCache(cfg.n_layers, t),
              GrowableCache(cfg.n_layers, t)]
    with torch.inference_mode():
        for cache in caches:
            model(ids, cache)
            assert cache.nbytes == expected, type(cache).__name__
        _, pairs = model(ids, None, return_cache=True)
    assert sum(k.nbytes + v.nbytes for k, v in pairs) == expected
    assert isinstance(PairsCache(cfg.n_layers, pairs).length(), int)


def test_decode_bytes_count_weights_once_and_one_position_row():
    cfg = get_config("tiny")
    model = random_model("tiny", torch.device("cpu"))
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)  # biases and LayerNorm
    weights, kv = step_bytes(model, 10)
    assert weights == 4 * (linear_params(cfg) + vectors + cfg.d_model)
    assert kv == kv_cache_bytes(cfg.n_layers, 1, 10, cfg.n_kv_heads, cfg.head_dim, 4)


# -- the roofline's record: every prediction is the pure function of what was counted and measured -------------------

def _check_prediction(values: dict, cfg, p: dict) -> None:
    """A recorded point's predictions are `predict` of its counted cost with what was measured beside it."""
    from labcode.bench.roofline import cost_of, machine_at, stream_machine
    from labcode.roofline import predict

    cost = cost_of(cfg, p["kind"], p["t_new"], p["s_mid"], p["batch"])
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        plain = machine_at(values["roofline_machine"], p, clock)
        assert plain.overhead_s_per_op == p["overhead" + suffix + "_s_per_op"] > 0  # measured beside the point
        assert p["plain" + suffix]["seconds"] == predict(cost, plain, p["ops"]).seconds
        with_ceilings = stream_machine(plain, p["ceilings" + suffix], p["batch"] * p["t_new"],
                                       p["products_flops" + suffix])
        assert p["predicted" + suffix]["seconds"] == predict(cost, with_ceilings, p["ops"]).seconds
        assert p["ratio" + suffix] == p["step" + suffix + "_s"] / p["predicted" + suffix]["seconds"]
        assert p["ratio_plain" + suffix] == p["step" + suffix + "_s"] / p["plain" + suffix]["seconds"]
        if p["products_flops" + suffix] is None:  # a memory-side ceiling only ever slows a prediction down
            assert p["predicted" + suffix]["seconds"] >= p["plain" + suffix]["seconds"]


def test_every_roofline_point_is_predicted_from_its_counted_cost(bench_run):
    from labcode.bench.roofline import cost_of

    values = bench_run[0]["values"]
    kinds = set()
    for preset, run in values["roofline"].items():
        cfg = get_config(preset)
        for p in run["points"]:
            kinds.add(p["kind"])
            cost = cost_of(cfg, p["kind"], p["t_new"], p["s_mid"], p["batch"])
            assert p["flops"] == cost.flops and p["bytes"] == cost.bytes and p["ops"] > 0
            _check_prediction(values, cfg, p)
            if p["kind"] != "decode":  # keys and values are read beside decode steps only
                assert "K/V" not in p["ceilings"] and "K/V" not in p["ceilings_cpu"]
    assert kinds == {"prefill", "decode", "uncached"}
    summary = values["roofline_summary"]
    assert set(summary["crossover"]) == set(values["roofline"]) == set(SIZES["test"].roofline_presets)


def test_stream_probe_streams_each_weight_shape_and_the_decode_kv_read():
    from labcode.bench.roofline import StreamProbe, shape_name
    from labcode.roofline import decode_cost, weight_shapes

    cfg = get_config("tiny").with_(vocab_size=20000)  # a head of 1.28M elements: wide enough to be stored by column
    assert list(StreamProbe(cfg, torch.device("cpu"), min_mbytes=1).weights) == [(20000, 64)]  # the others: 16 KB
    probe = StreamProbe(cfg, torch.device("cpu"), min_mbytes=1, min_matrix_kbytes=0)
    stream = probe.at(2, 9)
    nbytes, ops, one_round = stream.nbytes, stream.ops, stream.one_round
    assert set(nbytes) == set(ops) == {shape_name(o, i) for o, i, _ in weight_shapes(cfg)} | {"K/V"}
    assert stream.flops == stream.call_flops == {}  # with no balance given, every product is memory-bound
    for (o, i), ws in probe.weights.items():
        assert nbytes[shape_name(o, i)] == 4 * o * i * len(ws) >= 2**20  # enough copies to leave the caches
        assert all(w.shape == (o, i) and w.stride() == ((1, o) if (o, i) == (20000, 64) else (i, 1)) for w in ws)
    cost = decode_cost(cfg, 8, 2)  # 9 keys for each of 2 sequences
    assert nbytes["K/V"] == cost.kv_read_bytes + cost.act_attention_bytes
    assert all(n > 0 for n in ops.values())
    timed_calls = one_round()
    assert set(timed_calls) == set(nbytes) and all(len(v) == 1 and min(v[0]) >= 0 for v in timed_calls.values())
    # with a balance this low every product is compute-bound: only the K/V read is memory-bound; the products are
    # still timed, by their FLOPs (the probe's, and the call's own through each shape: its weight)
    bound = probe.at(2, 9, balance=0.1)
    assert set(bound.nbytes) == {"K/V"} and set(bound.ops) == set(ops)
    assert bound.flops == {shape_name(o, i): 2 * 2 * o * i * len(ws) for (o, i), ws in probe.weights.items()}
    assert bound.call_flops == {shape_name(o, i): 2 * 2 * o * i * k for o, i, k in weight_shapes(cfg)}
    assert "K/V" not in probe.at(1).nbytes


def test_ceilings_leave_out_the_fixed_cost_and_parts_that_measured_only_dispatch():
    from labcode.bench.roofline import ceilings, stream_machine
    from labcode.roofline import Machine

    nbytes, ops = {"16x16": 1000, "64x16": 1000, "K/V": 100}, {"16x16": 10, "64x16": 10, "K/V": 4}
    seconds = {"16x16": (1e-3, 2e-3), "64x16": (1.5e-4, 1.5e-4), "K/V": (1e-4, 1e-4)}
    # at 1e6 bytes/s every part's bytes take longer than its fixed cost (1e-4 s, 1e-4 s, 4e-5 s); the 64x16 part
    # spent more than half its time on it
    assert ceilings(nbytes, ops, seconds, 1e-5, 1e6) == {"16x16": pytest.approx(1000 / 9e-4),
                                                         "K/V": pytest.approx(100 / 6e-5)}
    assert ceilings(nbytes, ops, seconds, 1e-5, 1e6, clock=1)["16x16"] == pytest.approx(1000 / 1.9e-3)
    # at 1e7 bytes/s the K/V's 100 bytes take 1e-5 s, less than its operations' fixed cost: no ceiling
    assert set(ceilings(nbytes, ops, seconds, 1e-5, 1e7)) == {"16x16"}
    machine = stream_machine(Machine(1e9, 1e8), {"16x16": 5e7, "K/V": 4e7}, 2)
    assert machine.stream_ceilings == ((16, 16, 2, 5e7),) and machine.kv_bandwidth_bytes_per_s == 4e7
    assert stream_machine(Machine(1e9, 1e8), {}, 1) == Machine(1e9, 1e8)
    assert stream_machine(Machine(1e9, 1e8), {}, 1, 5e8).products_flops_per_s == 5e8


def test_the_compute_ceiling_weights_each_shape_by_the_calls_flops():
    from labcode.bench.roofline import StreamRound, compute_ceiling

    # two compute-bound shapes: the probe did 1e6 FLOPs through each; the call does 3e6 through "a", 1e6 through
    # "b"; each part dispatched 10 operations at 1e-5 s
    stream = StreamRound({}, {"a": 10, "b": 10}, dict, {"a": 1e6, "b": 1e6}, {"a": 3e6, "b": 1e6})
    seconds = {"a": (1.1e-3, 2.1e-3), "b": (2.1e-3, 2.1e-3)}  # less the fixed cost: 1e-3 s (1e9/s), 2e-3 s
    assert compute_ceiling(stream, seconds, 1e-5) == pytest.approx(4e6 / (3e6 / 1e9 + 1e6 / 5e8))
    assert compute_ceiling(stream, seconds, 1e-5, clock=1) == pytest.approx(5e8)
    # a part whose fixed cost was more than half its time measured the dispatch: it is left out
    assert compute_ceiling(stream, {"a": (1.1e-3, 0), "b": (3e-4, 0)}, 2e-5) == pytest.approx(1e6 / 9e-4)
    assert compute_ceiling(stream, {"a": (3e-4, 0), "b": (3e-4, 0)}, 2e-5) is None
    assert compute_ceiling(StreamRound({}, {}, dict), {}, 1e-5) is None  # nothing compute-bound


def test_batch_sweep_holds_every_batch_with_its_prediction(bench_run):
    values = bench_run[0]["values"]
    for preset, batches, contexts in SIZES["test"].batch_runs:
        result = values["batch"][preset]
        assert [r["s_cached"] for r in result["runs"]] == list(contexts)
        for r in result["runs"]:
            assert r["batch"] == list(batches) and len(r["step_s"]) == len(r["predicted"]["step_s"]) == len(batches)
            assert r["tokens_per_s"] == [b / t for b, t in zip(batches, r["step_s"], strict=True)]
            for i, b in enumerate(batches):  # each batch predicted with what was measured beside it
                point = {"kind": "decode", "t_new": 1, "s_mid": r["s_mid"], "batch": b, "ops": r["ops_by_batch"][i],
                         **{k: r[k][i] for k in ("step_s", "step_cpu_s", "overhead_s_per_op", "overhead_cpu_s_per_op",
                                                 "ceilings", "ceilings_cpu", "ratio", "ratio_cpu", "ratio_plain",
                                                 "ratio_plain_cpu", "products_flops", "products_flops_cpu")},
                         **{k: {"seconds": r[k]["step_s"][i]} for k in ("predicted", "predicted_cpu", "plain",
                                                                        "plain_cpu")}}
                _check_prediction(values, get_config(preset), point)
        assert len(result["curve"]["contexts"]) == len(result["curve"]["n_kv_heads"]["4"]["critical_batch"])


def test_memory_record_and_window_comparison(bench_run):
    values = bench_run[0]["values"]
    assert values["memory"]["allocation"]["agrees"] is True
    assert set(values["memory"]["concurrency"]["tables"]) == {str(n) for n in SIZES["test"].memory_lengths}
    wc = values["window_vs_concat"]
    assert len(wc["window_s"]) == len(wc["cat_s"]) == len(wc["positions"]) == len(SIZES["test"].window_concat_positions)
    ops = values["floor_ops"]
    assert {"q/k/v projections", "head", "attention", "other"} <= set(ops["model"]["operations"])
    assert {"K read (scores)", "V read (weights @ V)"} <= set(ops["lean"]["operations"])


@pytest.mark.parametrize("name", ["tiny", "gqa", "mqa", "rotary"])
@pytest.mark.parametrize("lean", [False, True])
def test_lean_decode_step_computes_the_models_logits(name, lean):
    from labcode.bench.floor import LeanDecode

    cfg = {"tiny": get_config("tiny"), "gqa": get_config("tiny", n_kv_heads=2), "mqa": get_config("tiny", n_kv_heads=1),
           "rotary": get_config("tiny", rotary=True, n_kv_heads=2)}[name]
    model = _model(cfg).double()
    layouts = {(3 * cfg.d_model if name == "tiny" else cfg.d_model + 2 * cfg.n_kv_heads * cfg.head_dim, cfg.d_model):
               "col", (4 * cfg.d_model, cfg.d_model): "col"}
    step = LeanDecode(model, lean=lean, layouts=layouts)
    with torch.inference_mode():
        for batch in (1, 2):  # one row goes through addmv, several through F.linear
            mine, ref = (WindowCache(cfg.n_layers, cfg.context_length) for _ in range(2))
            ids = torch.randint(0, cfg.vocab_size, (batch, 7), generator=torch.Generator().manual_seed(batch))
            for t in range(7):
                a, b = decode_step(step, ids[:, t], mine), decode_step(model, ids[:, t], ref)
                assert (a - b).abs().max() <= 1e-12, (batch, t)
            assert mine.position == ref.position == 7  # and the cache holds the same keys (addmv sums in another order)
            assert (mine.read(1)[0] - ref.read(1)[0]).abs().max() <= (1e-12 if lean else 0.0)
    for position in (1, 30):  # the benchmark's own check of the same, as it records it
        assert _logit_diffs(model, {"lean": _ModelStep(model, cfg.context_length, step)}, position)["lean"] <= 1e-12


def test_floor_bytes_are_the_weights_and_the_kv():
    from labcode.bench.floor import category_bytes

    for cfg in CONFIGS.values():
        nbytes = category_bytes(cfg, keys=9)
        matrices = ("q/k/v projections", "output projection", "MLP up", "MLP down", "head")
        biases = cfg.n_layers * (cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + 6 * cfg.d_model)
        assert sum(nbytes[k] for k in matrices) == 4 * (linear_params(cfg) + biases)
        assert nbytes["attention"] == kv_cache_bytes(cfg.n_layers, 1, 9, cfg.n_kv_heads, cfg.head_dim, 4)


def test_speedup_and_overhead_crossover_come_from_the_roofline(bench_run):
    from labcode.bench import roofline_speedup
    from labcode.bench.roofline import machine_of, overhead_crossover
    from labcode.roofline import Machine, decode_cost, prefill_cost, uncached_cost

    values = bench_run[0]["values"]
    summary = values["roofline_summary"]
    gen = summary["generation"]["tiny"]  # the test sizes time generation and the roofline at tiny
    assert gen["predicted_speedup"] == gen["predicted_nocache_s"] / gen["predicted_cached_s"]
    assert gen["ratio"] == gen["measured_speedup"] / gen["predicted_speedup"]
    # by hand: a machine with no overhead and no limit but bandwidth predicts bytes / bandwidth per call
    run = {"prompt_len": 2, "new_tokens": 3, "speedup": {"window": 1.0}, "total_s": {"nocache": 1.0, "window": 1.0}}
    pts = {"points": [{"kind": k, "ops": 5} for k in ("prefill", "decode", "uncached")]}
    cfg, machine = get_config("micro"), Machine(1e30, 1e6)
    nocache = sum(uncached_cost(cfg, n).bytes for n in (2, 3, 4)) / 1e6
    cached = (prefill_cost(cfg, 2).bytes + decode_cost(cfg, 2).bytes + decode_cost(cfg, 3).bytes) / 1e6
    assert roofline_speedup(cfg, run, pts, machine)["predicted_speedup"] == pytest.approx(nocache / cached)
    # the crossover: the smallest width whose bytes outweigh the operations' fixed cost
    cross = overhead_crossover(get_config("tiny"), machine_of(values["roofline_machine"]), ops=80)
    above = [r for r in cross["widths"] if r["t_parts"] >= r["t_overhead"]]
    assert cross["crossover_d_model"] == min(r["d_model"] for r in above)
    assert all(r["t_parts"] < r["t_overhead"] for r in cross["widths"] if r["d_model"] < cross["crossover_d_model"])


def test_wall_over_cpu_is_the_median_of_the_timed_calls():
    from labcode.bench.roofline import wall_over_cpu

    points = [{"step_s": w, "step_cpu_s": c} for w, c in ((2.0, 1.0), (3.0, 1.0), (1.0, 1.0))]
    assert wall_over_cpu({"a": {"points": points[:2]}, "b": {"points": points[2:]}}) == (2.0, 3)
    with pytest.raises(ValueError, match="roofline"):
        wall_over_cpu({"a": {"points": []}})


def test_clock_note_says_shared_only_when_the_clocks_disagree():
    from labcode.bench.roofline import clock_note

    def run(wall: float) -> dict:
        return {"a": {"points": [{"step_s": wall, "step_cpu_s": 1.0}] * 3}}

    assert "shared" in clock_note(run(2.5)) and "2.5 times" in clock_note(run(2.5))
    assert "shared" not in clock_note(run(1.05)) and "to itself" in clock_note(run(1.05))


def test_committed_record_targets_follow_from_its_values():
    """The record's targets are `targets` of its own values: the code that judges them and the record agree."""
    import json
    import math

    from labcode.bench.targets import targets
    from labcode.results import repo_root

    doc = json.loads((repo_root() / "qa" / "results" / "bench.json").read_text())

    def same(a, b) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return a == b or (math.isnan(a) and math.isnan(b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    recomputed = json.loads(json.dumps(targets(doc["values"])))
    assert [t["name"] for t in recomputed] == [t["name"] for t in doc["values"]["targets"]]
    assert same(recomputed, doc["values"]["targets"])


def test_the_fixed_cost_is_measured_on_the_calls_own_model_shrunk_at_its_batch():
    """The probe beside a decode step of B sequences steps the same model shrunk (its layers and heads) for as many
    sequences: it dispatches exactly the operations the step does."""
    from labcode.bench.roofline import count_ops, fill_cache, overhead_probe, shrunk_model
    from labcode.caches import WindowCache
    from labcode.generate import decode_step

    cfg, cpu = get_config("tiny"), torch.device("cpu")
    model = random_model("tiny", cpu)
    for batch in (1, 3):
        ops, probe = overhead_probe(cfg, cpu, steps=2, batch=batch)
        with torch.inference_mode():
            cache = WindowCache(cfg.n_layers, cfg.context_length)
            fill_cache(cache, model, batch, 8)
            token = torch.zeros(batch, dtype=torch.long)
            decode_step(model, token, cache)
            assert ops == count_ops(lambda t=token, c=cache: decode_step(model, t, c))
            timed_calls = probe()
        assert len(timed_calls) == 2 and all(w > 0 and c >= 0 for w, c in timed_calls)
    small = shrunk_model(cfg, cpu).cfg
    assert (small.n_layers, small.n_heads, small.head_dim) == (cfg.n_layers, cfg.n_heads, 4)


def test_torch_threads_sets_the_count_for_the_block_and_restores_it():
    """The appendix measures the machine on the record's thread count without pinning the reader's: the count
    is set inside the block only, and restored even when the block raises."""
    from labcode.bench.timing import torch_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError), torch_threads(0):
        pass
