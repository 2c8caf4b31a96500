"""The roofline of chapter 7: FLOPs and bytes per forward call, counted by hand, and the time they predict.

Every expected number below is worked out by hand from the `micro` preset (L = 2, H = Hkv = 2,
C = 16, D = 8, V = 64); the comments show the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from labcode import GPT, get_config
from labcode.flops import forward_flops, linear_params
from labcode.roofline import (
    Machine,
    StepCost,
    context_limit,
    critical_batch,
    decode_cost,
    element_bytes,
    predict,
    prefill_cost,
    step_cost,
    uncached_cost,
    weight_elements,
    weights_critical_batch,
)

MICRO = get_config("micro")


def test_micro_counts_by_hand():
    assert linear_params(MICRO) == 2 * (16 * 16 + 16 * 32 + 16 * 16 + 8 * 16 * 16) + 16 * 64 == 7168
    # per layer: q bias 16, kv bias 32, out bias 16, fc bias 64, proj bias 16, two LayerNorms 2 x 32; ln_f 32
    assert weight_elements(MICRO, 1) == 7168 + 2 * 208 + 32 + 1 * 16 == 7632
    assert weight_elements(MICRO, 40) == 7168 + 448 + 16 * 16  # no more rows than the position table holds


def test_weights_are_every_parameter_and_one_row_of_positions_per_token():
    for cfg in (MICRO, get_config("tiny"), get_config("tiny", n_kv_heads=1)):
        model = GPT(cfg)
        table = model.pos_emb.weight.numel()
        assert weight_elements(cfg, 3) == model.num_params() - table + 3 * cfg.d_model
    rotary = get_config("tiny", rotary=True)
    assert weight_elements(rotary, 5) == GPT(rotary).num_params()  # no position table to read


def test_decode_step_at_micro_by_hand():
    cost = decode_cost(MICRO, 5)  # one token after 5 cached, B = 1, float32
    assert cost == StepCost(
        flops_linear=2 * 7168,  # 2 FLOPs per weight
        flops_attention=4 * 2 * 2 * 1 * 6 * 8,  # 4 L H T (S + T) D
        weight_bytes=4 * 7632,
        kv_read_bytes=6 * (2 * 2 * 2 * 8 * 4),  # 6 keys x (K and V, 2 layers, 2 heads, D = 8, 4 bytes)
        kv_write_bytes=1 * 256,
        # per layer: q 16 + 16, kv 16 + 32, out 16 + 16, fc 16 + 64, proj 64 + 16 = 272; head 16 + 64
        act_linear_bytes=4 * (2 * 272 + 16 + 64),
        # per layer: q read and output written (2 x 16), 6 passes over the 2 x 1 x 6 scores (no mask at T = 1)
        act_attention_bytes=4 * 2 * (2 * 16 + 6 * 2 * 6),
        # per layer: LayerNorms 4C, GELU 8C, residual additions 6C; once: embeddings 4C, ln_f 2C; new K/V read 2 x 16
        act_other_bytes=4 * (2 * 18 * 16 + 6 * 16 + 2 * 32),
        # q and out [16, 16] in 2 layers; kv [32, 16]; fc [64, 16] in 2 layers and the head [64, 16]; proj [16, 64]
        shape_bytes=((16, 16, 4 * 4 * 256), (32, 16, 4 * 2 * 512), (64, 16, 4 * 3 * 1024), (16, 64, 4 * 2 * 1024)),
        queries=1,
    )
    assert sum(n for *_, n in cost.shape_bytes) == 4 * linear_params(MICRO)
    assert cost.flops == 15104 and cost.bytes == 30528 + 1536 + 256 + 2496 + 832 + 2944 == 38592
    assert cost.intensity == pytest.approx(15104 / 38592)


def test_prefill_chunk_in_bfloat16_by_hand():
    cost = prefill_cost(MICRO, 4, 3, batch=2, dtype=torch.bfloat16)  # 4 new tokens after 3 cached, B = 2
    assert cost.flops_linear == 2 * 2 * 4 * 7168
    assert cost.flops_attention == 4 * 2 * 2 * 2 * 4 * 7 * 8  # B L H T (S + T) D
    assert cost.weight_bytes == 2 * (7168 + 448 + 4 * 16)
    assert cost.kv_read_bytes == 2 * 7 * 128 and cost.kv_write_bytes == 2 * 4 * 128  # 128 bytes per token
    assert cost.act_linear_bytes == 2 * 8 * 624  # 8 rows
    assert cost.act_attention_bytes == 2 * 2 * (2 * 8 * 16 + 8 * 2 * 2 * 4 * 7)  # 8 passes: the mask adds two
    assert cost.act_other_bytes == 2 * (8 * 672 + 2 * 8 * 32)


def test_uncached_step_reads_its_own_keys_and_writes_none():
    cost = uncached_cost(MICRO, 5)
    assert cost.kv_read_bytes == 5 * 256 and cost.kv_write_bytes == 0
    assert cost.act_other_bytes == 4 * 5 * 672  # no new K/V to copy into a cache
    assert cost.flops == forward_flops(MICRO, 5, 0, 1) == 2 * 5 * 7168 + 4 * 2 * 2 * 5 * 5 * 8
    with pytest.raises(ValueError, match="s_cached: expected 0 for a call without a cache, got 3"):
        step_cost(MICRO, 5, 3, cached=False)


@pytest.mark.parametrize("name", ["micro", "tiny", "small", "gpt2-124m"])
def test_flops_are_the_counted_flops_and_bytes_grow_linearly_in_batch(name):
    cfg = get_config(name)
    for t, s in ((1, 0), (1, 700 % cfg.context_length), (7, 3)):
        one, three = step_cost(cfg, t, s, 1), step_cost(cfg, t, s, 3)
        assert one.flops == forward_flops(cfg, t, s, 1) and three.flops == forward_flops(cfg, t, s, 3)
        assert three.weight_bytes == one.weight_bytes  # read once for the whole batch
        assert three.bytes - three.weight_bytes == 3 * (one.bytes - one.weight_bytes)


def test_quantised_cache_bytes_and_bad_input():
    assert decode_cost(MICRO, 9, kv_bytes_per_token=100).kv_read_bytes == 10 * 100
    assert element_bytes("bfloat16") == element_bytes(torch.float16) == 2 and element_bytes(torch.float64) == 8
    with pytest.raises(ValueError, match="dtype: expected one of"):
        element_bytes("float8")
    with pytest.raises(ValueError, match="t_new: expected an int >= 1, got 0"):
        step_cost(MICRO, 0)
    with pytest.raises(ValueError, match="batch: expected an int >= 1, got 2.0"):
        step_cost(MICRO, 1, 0, 2.0)
    with pytest.raises(ValueError, match="Machine.bandwidth_bytes_per_s: expected a positive number"):
        Machine(1e9, 0.0)


def test_prediction_of_a_memory_bound_step_by_hand():
    machine = Machine(peak_flops_per_s=1e9, bandwidth_bytes_per_s=1e8, overhead_s_per_op=1e-6)
    p = predict(decode_cost(MICRO, 5), machine, ops=100)
    # every part is memory-bound: (33024 + 2368 + 3200) bytes / 1e8 = 385.92 µs, plus 100 operations x 1 µs
    assert p.t_memory == pytest.approx(38592 / 1e8) and p.t_math == pytest.approx(15104 / 1e9)
    assert p.t_parts == pytest.approx(385.92e-6) and p.t_overhead == pytest.approx(100e-6)
    assert p.seconds == pytest.approx(485.92e-6) and p.bound == "memory"
    assert p.t_roofline == p.t_memory
    overlapped = Machine(1e9, 1e8, 1e-6, overlapped=True)  # a GPU queues operations: the overhead hides
    assert predict(decode_cost(MICRO, 5), overlapped, ops=100).seconds == pytest.approx(385.92e-6)
    assert predict(decode_cost(MICRO, 5), overlapped, ops=1000).bound == "overhead"


def test_each_kind_of_operation_is_held_to_its_own_limit():
    machine = Machine(peak_flops_per_s=1e6, bandwidth_bytes_per_s=1e8)
    p = predict(decode_cost(MICRO, 5), machine)
    # products: max(14336 / 1e6, 33024 / 1e8) = 14.336 ms; attention: max(0.768 ms, 0.02368 ms); elementwise 0.032 ms
    assert p.t_parts == pytest.approx(14.336e-3 + 0.768e-3 + 0.032e-3)
    assert p.t_parts >= p.t_roofline == p.t_math and p.bound == "compute"


def test_products_with_few_rows_are_held_to_their_measured_ceiling():
    # ceilings: 1e6 FLOP/s at 16 rows, 4e6 at 256; the peak 8e6 from 256 rows on
    machine = Machine(peak_flops_per_s=8e6, bandwidth_bytes_per_s=1e8, row_ceilings=((16, 1e6), (256, 4e6)))
    assert machine.peak_for(1) == machine.peak_for(16) == 1e6  # below the fewest measured: that ceiling
    assert machine.peak_for(64) == pytest.approx(2e6)  # halfway on log-log axes: 64 = sqrt(16 * 256), 2e6 likewise
    assert machine.peak_for(256) == machine.peak_for(10**6) == 8e6  # from the most measured rows on: the peak
    assert Machine(8e6, 1e8).peak_for(1) == 8e6  # no ceilings: every product can reach the peak
    assert Machine(1e6, 1e8, row_ceilings=((16, 5e6),)).peak_for(4) == 1e6  # never above the peak
    # a prefill of T = 64 rows: products 2 * 64 * 7168 = 917504 FLOPs at 2e6 FLOP/s, attention at the peak
    cost = prefill_cost(MICRO, 64)
    assert cost.rows == 64 and decode_cost(MICRO, 5, batch=3).rows == 3
    p = predict(cost, machine)
    assert cost.flops_linear == 917504
    assert p.t_math == pytest.approx(917504 / 2e6 + cost.flops_attention / 8e6)
    products = max(cost.flops_linear / 2e6, sum(cost.parts()["products with weights"][1:]) / 1e8)
    assert p.t_parts >= products == pytest.approx(917504 / 2e6)
    for bad in (((16, 1e6), (16, 2e6)), ((256, 1e6), (16, 2e6)), ((0, 1e6),), ((16, 0.0),)):
        with pytest.raises(ValueError, match="Machine.row_ceilings"):
            Machine(8e6, 1e8, row_ceilings=bad)


def test_memory_bound_products_and_decode_kv_reads_are_held_to_their_stream_ceilings():
    # at micro: weights [16, 16] 4096 bytes, [32, 16] 4096, [64, 16] 12288, [16, 64] 8192; 1856 more (vectors, a
    # position row) and 2496 of the products' activations; attention reads 1536 bytes of K/V and moves 832 more
    streams = ((16, 16, 1, 5e7), (64, 16, 1, 2.5e7))
    machine = Machine(peak_flops_per_s=1e12, bandwidth_bytes_per_s=1e8, stream_ceilings=streams,
                      kv_bandwidth_bytes_per_s=5e7)
    p = predict(decode_cost(MICRO, 5), machine)
    products = 4096 / 5e7 + 4096 / 1e8 + 12288 / 2.5e7 + 8192 / 1e8 + (1856 + 2496) / 1e8
    attention = (1536 + 832) / 5e7  # the K/V rate covers all that decode attention moves, as it is measured
    assert p.t_parts == pytest.approx(products + attention + (256 + 2944) / 1e8)
    assert p.t_memory == pytest.approx(38592 / 1e8)  # the roofline as drawn keeps one bandwidth
    plain = predict(decode_cost(MICRO, 5), Machine(1e12, 1e8))
    assert plain.t_parts == pytest.approx(38592 / 1e8) and plain.t_parts < p.t_parts
    # a prefill's attention (4 queries per sequence) is not a decode read: only the weights' ceilings apply (at
    # 4 rows the shapes measured with one row keep their rate)
    chunk = prefill_cost(MICRO, 4, 5)
    assert chunk.queries == 4
    no_kv = Machine(1e12, 1e8, stream_ceilings=streams)
    assert predict(chunk, machine).t_parts == pytest.approx(predict(chunk, no_kv).t_parts)
    # between measured rows on log-log axes; beyond the most, the bandwidth; never above it; other shapes: it
    two = Machine(1e12, 1e8, stream_ceilings=((16, 16, 1, 5e7), (16, 16, 4, 2e7), (32, 16, 1, 5e8)))
    assert two.stream_for(16, 16, 2) == pytest.approx(math.sqrt(5e7 * 2e7))
    assert two.stream_for(16, 16, 1) == 5e7 and two.stream_for(16, 16, 4) == 2e7
    assert two.stream_for(16, 16, 8) == 1e8 and two.stream_for(32, 16, 1) == 1e8 == two.stream_for(64, 16, 1)
    for bad in (((16, 16, 1, 5e7), (16, 16, 1, 4e7)), ((16, 16, 0, 5e7),), ((16, 16, 1, 0.0),), ((16.5, 16, 1, 1.0),)):
        with pytest.raises(ValueError, match="Machine.stream_ceilings"):
            Machine(1e12, 1e8, stream_ceilings=bad)
    with pytest.raises(ValueError, match="Machine.kv_bandwidth_bytes_per_s"):
        Machine(1e12, 1e8, kv_bandwidth_bytes_per_s=0.0)


def test_products_measured_beside_a_call_hold_it_instead_of_the_soft_ridge():
    cost = prefill_cost(MICRO, 8)
    ridge = Machine(8e6, 1e12, row_ceilings=((4, 1e6), (64, 4e6)))
    beside = replace(ridge, products_flops_per_s=2e7)  # faster than the peak: a rate of the same products
    assert predict(cost, ridge).t_math == pytest.approx(cost.flops_linear / ridge.peak_for(8)
                                                        + cost.flops_attention / 8e6)
    assert predict(cost, beside).t_math == pytest.approx(cost.flops_linear / 2e7 + cost.flops_attention / 8e6)
    assert predict(cost, beside).t_parts < predict(cost, ridge).t_parts
    with pytest.raises(ValueError, match="Machine.products_flops_per_s"):
        Machine(1e12, 1e8, products_flops_per_s=-1.0)


def test_weight_shapes_are_every_product_with_weights():
    from labcode.roofline import weight_shapes

    for name in ("micro", "tiny", "small", "gpt2-124m", "smollm2-135m"):
        cfg = get_config(name)
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            model = GPT(cfg)
        shapes: dict = {}
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
        head = tuple(model.tok_emb.weight.shape)  # the tied head multiplies by the embedding table
        shapes[head] = shapes.get(head, 0) + 1
        assert sorted(weight_shapes(cfg)) == sorted((o, i, k) for (o, i), k in shapes.items()), name


def test_only_compute_bound_row_measurements_become_ceilings():
    from labcode.bench.roofline import machine_at, machine_of

    measured = {"wall": {"peak_flops_per_s": 8e6, "bandwidth_bytes_per_s": 1e6, "overhead_s_per_op": 1e-6,
                         "overlapped": False},
                "rows": [{"rows": 64, "flops_per_s": 6e6, "cpu_flops_per_s": 5e6, "intensity": 30.0},
                         {"rows": 1, "flops_per_s": 1e5, "cpu_flops_per_s": 1e5, "intensity": 0.5},
                         {"rows": 16, "flops_per_s": 3e6, "cpu_flops_per_s": 2e6, "intensity": 8.0}]}
    measured["cpu"] = measured["wall"]
    # the balance is 8 FLOPs per byte: the one-row product measured the bandwidth, not a ceiling
    assert machine_of(measured).row_ceilings == ((16, 3e6), (64, 6e6))
    assert machine_of(measured, "cpu").row_ceilings == ((16, 2e6), (64, 5e6))
    assert machine_of({"wall": measured["wall"]}).row_ceilings == ()
    point = {"overhead_s_per_op": 3e-6, "overhead_cpu_s_per_op": 2e-6}
    assert machine_at(measured, point).overhead_s_per_op == 3e-6
    assert machine_at(measured, point, "cpu").overhead_s_per_op == 2e-6
    assert machine_at(measured, {}).overhead_s_per_op == 1e-6


def test_critical_batch_by_hand_and_by_its_definition():
    machine = Machine(peak_flops_per_s=1e9, bandwidth_bytes_per_s=1e9)
    # w = 30528 bytes, each sequence 15104 FLOPs and 38592 - 30528 = 8064 bytes: B* = 30528 / (15104 - 8064)
    b = critical_batch(MICRO, 5, machine)
    assert b == pytest.approx(30528 / 7040)
    below, above = (predict(decode_cost(MICRO, 5, n), machine) for n in (math.floor(b), math.ceil(b)))
    assert below.t_math < below.t_memory and above.t_math >= above.t_memory
    assert weights_critical_batch(MICRO, machine) == pytest.approx(30528 / 14336)


def test_long_contexts_are_never_compute_bound():
    cfg = get_config("gpt2-124m")
    machine = Machine(peak_flops_per_s=50e9, bandwidth_bytes_per_s=10e9)
    s_max = context_limit(cfg, machine)
    assert 0 < s_max < math.inf
    assert critical_batch(cfg, math.floor(s_max), machine) < math.inf
    assert critical_batch(cfg, math.ceil(s_max), machine) == math.inf
    assert critical_batch(cfg, 0, machine) < critical_batch(cfg, 512, machine)  # the K/V push it out
    # memory so fast that every key's FLOPs outweigh its bytes: some batch is compute-bound at any length
    assert context_limit(cfg, Machine(peak_flops_per_s=1e9, bandwidth_bytes_per_s=1e12)) == math.inf
    # arithmetic so fast that no batch is compute-bound even with nothing cached
    assert context_limit(cfg, Machine(peak_flops_per_s=1e15, bandwidth_bytes_per_s=1e9)) == 0.0


def test_attention_intensity_by_hand():
    from labcode.roofline import attention_intensity

    # micro, one token after 5 cached: 768 FLOPs; 1536 bytes of K/V, 256 of queries and outputs, 576 of scores
    assert attention_intensity(MICRO, 1, 5, fused=True) == pytest.approx(768 / (1536 + 256))
    assert attention_intensity(MICRO, 1, 5) == pytest.approx(768 / (1536 + 256 + 576))
    # a long decode step reads 2 Hkv D elements per key for 4 H D FLOPs: 2 (H / Hkv) / bytes per element
    gpt2 = get_config("gpt2-124m")
    for hkv, dtype, e in ((12, torch.float32, 4), (3, torch.float32, 4), (1, torch.bfloat16, 2)):
        i = attention_intensity(gpt2.with_(n_kv_heads=hkv), 1, 100_000, fused=True, dtype=dtype)
        assert i == pytest.approx(2 * 12 / hkv / e, rel=1e-3)  # queries and outputs: 12 / 100,000 at most
    # a fused prefill's intensity grows with T (T / 4 in float32 MHA); eager attention's stops at its score passes
    assert attention_intensity(gpt2, 512, fused=True) == pytest.approx(512 / 4)
    assert attention_intensity(gpt2, 512) < attention_intensity(gpt2, 512, fused=True) / 10
