"""The fused decode step of chapter 7 (`labcode.fused`): the step a compiler fuses, proved equal here.

The test command never compiles (a compile costs tens of seconds to minutes); it proves the
eager fused step equal to the model's full pass in float64, with every model option the
step accepts, and the benchmark (`python -m labcode.bench --full`) compares the compiled
step with it and records the difference. Bad input is refused and leaves the step as it was.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import TOL64

from labcode import GPT, GPTConfig
from labcode.bench.compiled import bench_compiled, float64_check
from labcode.bench.floor import LeanDecode, step_bytes
from labcode.bench.targets import TARGETS, targets
from labcode.bench.timing import Streamer
from labcode.cost import kv_cache_bytes
from labcode.fused import FusedDecode

CONFIGS = {
    "gpt2": GPTConfig(vocab_size=50, context_length=40, n_layers=2, n_heads=4, d_model=32),
    "llama": GPTConfig(vocab_size=50, context_length=40, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32,
                       rotary=True, norm="rmsnorm", mlp="swiglu", bias=False, d_ff=48),
    "mqa-rotary-gelu": GPTConfig(vocab_size=50, context_length=40, n_layers=2, n_heads=4, n_kv_heads=1, d_model=32,
                                 rotary=True, rope_base=500.0),
    "cla": GPTConfig(vocab_size=50, context_length=40, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, kv_share=2),
}


def _model(name: str, seed: int = 0) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(CONFIGS[name]).double().eval()


def _worst_after_prefill(step: FusedDecode, ids: torch.Tensor, full: torch.Tensor, prompt: int) -> float:
    """The largest |logit difference| from the full pass `full` of `step`'s steps over ids[:, prompt:] after
    prefilling the rest."""
    step.prefill(ids[:, :prompt])
    return max(float((step.step(ids[:, i : i + 1]) - full[:, i]).abs().max()) for i in range(prompt, ids.shape[1]))


@pytest.mark.parametrize("attention", ["sdpa", "reductions"])  # eager's, and the one a compiled step runs
@pytest.mark.parametrize("concat", [False, True], ids=["window", "concat"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_equals_the_full_pass_in_float64(name, batch, concat, attention):
    model = _model(name)
    ids = torch.randint(0, 50, (batch, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(ids)
    step = FusedDecode(model, 30, batch=batch, concat=concat)
    step.attention = attention
    first = step.prefill(ids[:, :5])
    assert (first - full[:, 4]).abs().max() <= TOL64
    worst = max(float((step.step(ids[:, i : i + 1]) - full[:, i]).abs().max()) for i in range(5, 24))
    assert worst <= TOL64
    assert step.position == 24


def test_fused_step_from_an_empty_buffer_equals_the_full_pass():
    model = _model("llama")
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(ids)
    step = FusedDecode(model)
    got = torch.stack([step.step(ids[:, i : i + 1])[0] for i in range(10)])
    assert (got - full[0]).abs().max() <= TOL64


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fused_weights_are_stored_by_column_where_the_rule_says_with_the_same_logits(name):
    model = _model(name)
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = model(ids)
    wide = FusedDecode(model, by_column=lambda n_out, n_in: n_out > n_in)
    for kept, lay in zip(FusedDecode(model).layers, wide.layers, strict=True):
        for key in ("qkv", "up") if wide.swiglu else ("qkv",):  # the fused weights (GELU's up is one weight)
            assert kept[key][0].stride(1) == 1  # the parts' order: row by row
            assert lay[key][0].stride(0) == 1 and torch.equal(lay[key][0], kept[key][0])  # by column, same values
    assert _worst_after_prefill(wide, ids, full, 4) <= TOL64


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_frozen_weights_are_the_same_tensors_as_constants_with_the_same_logits(name):
    """What a packed compile hands inductor: every weight a parameter without a gradient, sharing its storage, and
    the buffers and angles left as inputs; the eager step still computes the model's logits."""
    model = _model(name)
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = model(ids)
    step = FusedDecode(model)
    before = [t for lay in step.layers for k in ("qkv", "out", "up", "down") for t in lay[k] if t is not None]
    step.freeze_weights()
    after = [t for lay in step.layers for k in ("qkv", "out", "up", "down") for t in lay[k] if t is not None]
    weights = [*after, step.emb, *(t for t in step.lnf if t is not None)]
    assert all(isinstance(t, torch.nn.Parameter) and not t.requires_grad for t in weights)
    assert all(a.data_ptr() == b.data_ptr() and torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not any(isinstance(t, torch.nn.Parameter) for t in (*step.k, *step.v))
    assert _worst_after_prefill(step, ids, full, 4) <= TOL64


def test_the_streamer_reads_every_way_and_the_floor_takes_the_fastest():
    got = Streamer(1, torch.device("cpu")).measure(repeats=1)
    ways = ("row_major", "col_major", "sum")  # `packed` compiles: the full benchmark's only
    assert set(got) == {*ways, *(f"{w}_cpu" for w in ways), "best", "best_cpu"}
    assert got["best"] == max(got[w] for w in ways) and got["best_cpu"] == max(got[f"{w}_cpu"] for w in ways)
    streamer = Streamer(1, torch.device("cpu"))
    streamer.ways["instant"] = lambda: None  # a way that reads nothing: the fastest, so the floor's
    got = streamer.measure(repeats=1)
    assert got["best"] == got["instant"] and got["best_cpu"] == got["instant_cpu"]


def test_a_wrong_fused_weight_moves_the_logits():
    """A planted bug (the K half of the fused projection zeroed) is caught by the comparison above."""
    model = _model("gpt2")
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(ids)
    step = FusedDecode(model)
    w, _ = step.layers[0]["qkv"]
    hd = model.cfg.n_heads * model.cfg.head_dim
    bias = step.layers[0]["qkv"][1]
    step.layers[0]["qkv"] = (torch.cat((w[:hd], torch.zeros_like(w[hd : 2 * hd]), w[2 * hd :])), bias)
    step.prefill(ids[:, :4])
    moved = max(float((step.step(ids[:, i : i + 1]) - full[:, i]).abs().max()) for i in range(4, 12))
    assert moved > 1e6 * TOL64  # the bar above, missed by far


def test_float64_check_of_the_eager_step_passes():
    out = float64_check(_model("llama"), compile=False)
    assert set(out) == {"window", "concat"}
    assert all(r["max_logit_diff"] <= TOL64 and r["compile_s"] == 0.0 for r in out.values())


@pytest.mark.parametrize("cfg, match", [
    (GPTConfig(vocab_size=50, context_length=40, n_layers=2, n_heads=4, d_model=32, sliding_window=8),
     "sliding_window"),
    (GPTConfig(vocab_size=50, context_length=40, n_layers=2, n_heads=4, d_model=32, kv_latent=8), "kv_latent"),
])
def test_models_the_step_cannot_run_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        FusedDecode(GPT(cfg))


@pytest.mark.parametrize("capacity", [0, 41, -1])
def test_a_capacity_outside_the_position_table_is_refused(capacity):
    with pytest.raises(ValueError, match="FusedDecode capacity: expected 1..context_length 40"):
        FusedDecode(_model("gpt2"), capacity)


def _state(step: FusedDecode) -> tuple:
    return step.position, [t.clone() for t in step.k + step.v]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("concat", [False, True], ids=["window", "concat"])
def test_bad_steps_are_refused_and_change_nothing(concat):
    model = _model("gpt2")
    step = FusedDecode(model, 6, concat=concat)
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(4))
    step.prefill(ids[:, :3])
    before = _state(step)
    for bad in (ids[:, :2], ids[:, 0], torch.zeros(2, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match="step ids: expected shape \\(1, 1\\)"):
            step.step(bad)
        assert _same(before, _state(step))
    with pytest.raises(ValueError, match="prefill"):
        step.prefill(ids[:, :2])  # the buffers already hold a prompt
    assert _same(before, _state(step))
    for i in range(3, 6):
        step.step(ids[:, i : i + 1])
    full = _state(step)
    with pytest.raises(ValueError, match="step: expected a free position \\(capacity 6\\), got position 6"):
        step.step(ids[:, :1])
    assert _same(full, _state(step))


def test_step_bytes_are_the_weights_once_and_the_keys_read():
    model = _model("llama")  # no position table: every parameter once
    cfg = model.cfg
    for keys in (1, 7, 40):
        weights, kv = step_bytes(model, keys)
        assert weights == sum(p.nbytes for p in model.parameters())
        assert kv == kv_cache_bytes(cfg.n_layers, 1, keys, cfg.n_kv_heads, cfg.head_dim, model.dtype.itemsize)
    gpt = _model("gpt2")  # one row of the position table
    table = gpt.pos_emb.weight
    assert step_bytes(gpt, 3)[0] == sum(p.nbytes for p in gpt.parameters()) - table.nbytes + table[0].nbytes
    cla = _model("cla")  # two layers own K/V, four attend
    assert step_bytes(cla, 5)[1] == 2 * 2 * 5 * 2 * 8 * 8


def test_the_benchmark_records_every_eager_variant_and_its_targets():
    """The benchmark at test sizes, without compiling: every value it records, and targets with reasons."""
    model = GPT(GPTConfig(vocab_size=50, context_length=40, n_layers=2, n_heads=4, d_model=32)).eval()
    run = bench_compiled(model, "toy", (4, 20), 2, 1, Streamer(1, torch.device("cpu")), compile=False,
                         extra={"products only": LeanDecode(model, lean=False)})
    assert list(run["variants"]) == ["eager model", "products only", "fused eager"]
    assert run["positions"] == [4, 20] and run["compile_s"] == {}
    for v in run["variants"].values():
        assert len(v["step_s"]) == 2 and all(s > 0 for s in v["step_s"])
        for clock in ("", "_cpu"):  # each clock against the bandwidth measured on it
            assert v["over_floor" + clock] == [s / f for s, f in zip(v[f"step{clock}_s"], run[f"floor{clock}_s"],
                                                                      strict=True)]
            assert run[f"floor{clock}_s"] == [b / w for b, w in zip(run["floor_bytes"],
                                                                    run[f"bandwidth{clock}_bytes_per_s"], strict=True)]
    assert run["floor_bytes"] == [sum(step_bytes(model, p + 1)) for p in (4, 20)]  # the middle of 2 steps: p + 1
    assert set(run["max_logit_diff"]) == set(run["variants"]) and max(run["max_logit_diff"].values()) <= 1e-4
    assert set(run["operations"]) == {"eager model", "fused eager"}
    held = ("compiled_near_floor_{preset}", "compiled_speedup_{preset}", "compiled_window_not_slower")
    judged = targets({"compiled": {"runs": {"toy": run}}}, only=held)
    assert [t["name"] for t in judged] == ["compiled_near_floor_toy", "compiled_speedup_toy"]  # no concat: no window
    assert all("fused eager" in t["claim"] and t.get("reason", "x") for t in judged)
    assert judged[1]["measured"] == min(run["speedup"]["fused eager"])
    assert judged[0]["measured"] == max(run["variants"]["fused eager"]["over_floor"])
    forced = replace(next(t for t in TARGETS if t.name == "compiled_speedup_{preset}"), target=1e9)
    [missed] = [forced.judge(f) for f in forced.facts({"compiled": {"runs": {"toy": run}}}, forced.target)]
    assert not missed["met"] and missed["reason"].startswith("fused eager over eager: ")  # the reason is filled in
    assert targets({"compiled": None}, only=held) == []


def test_compile_times_are_recorded_from_an_empty_compile_cache(tmp_path, monkeypatch):
    import os

    from labcode.bench.compiled import fresh_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with fresh_compile_cache():
        inside = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert inside != str(tmp_path) and os.path.isdir(inside) and not os.listdir(inside)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path) and not os.path.exists(inside)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with fresh_compile_cache():
        pass
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_benchmark_times_the_real_model_with_its_head_stored_by_column():
    """As every model the benchmark times: the large wide weights (the tied head) by column, the values unchanged."""
    from labcode.bench.compiled import compiled_model
    from labcode.weights.smollm2 import load_smollm2

    head = compiled_model("smollm2-135m", torch.device("cpu")).tok_emb.weight
    assert head.stride() == (1, head.shape[0])
    assert torch.equal(head, load_smollm2(torch.float32, "cpu")[0].tok_emb.weight)


def test_the_benchmark_times_the_layouts_side_by_side_where_asked():
    """At the floor's preset every eager variant; at the `row_major_presets` the model with every weight row-major
    beside the model as the benchmark stores it (the layout's share of a whole step); elsewhere neither."""
    from labcode.bench import SIZES, compiled
    from labcode.results import QAResult

    sizes = replace(SIZES["test"], compiled_presets=("micro", "tiny"), row_major_presets=("micro",),
                    floor_preset="tiny")
    res = QAResult("bench", {}, machine_dependent=True)
    streamer = Streamer(sizes.bandwidth_mbytes, torch.device("cpu"))
    compiled.record(res, sizes, torch.device("cpu"), streamer, progress=False)
    runs = res.doc["values"]["compiled"]["runs"]
    assert list(runs["micro"]["variants"]) == ["eager model", "row-major weights", "fused eager"]
    assert list(runs["tiny"]["variants"]) == ["eager model", "row-major weights", "products only", "lean",
                                              "fused eager"]
    assert all(c["passed"] for c in res.doc["checks"] if c["name"].startswith("decode_step_logits_"))
    sizes = replace(sizes, row_major_presets=())
    res = QAResult("bench", {}, machine_dependent=True)
    compiled.record(res, sizes, torch.device("cpu"), streamer, progress=False)
    assert list(res.doc["values"]["compiled"]["runs"]["micro"]["variants"]) == ["eager model", "fused eager"]
