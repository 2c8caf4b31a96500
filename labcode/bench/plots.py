"""The figures of chapter 7 and its appendix, drawn from a benchmark result (the `values` of its JSON file).

Introduced in chapter 7. Each takes the plain dictionaries the JSON holds, so a committed result plots without running
anything; `PLOTS` names them all (`python -m labcode.bench --plots DIR` writes each as a PNG file), drawn in the book's
style by `labcode.plotting.figure`.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from labcode.plotting import COLOURS, INK, figure

US = 1e6
LABELS = {  # every contender of the append and generation benchmarks, for tables
    "nocache": "no cache (full forward each step)",
    "cat": "ConcatCache (torch.cat)",
    "slice": "WindowCache (slice write)",
    "window": "WindowCache (slice write)",
    "ring": "RingCache (index_copy_)",
    "grow_linear": "GrowableCache, linear growth",
    "grow_double": "GrowableCache, doubling",
    "bare_cat": "bare torch.cat per layer",
    "bare_slice": "bare narrow().copy_() per layer",
    "fused_slice": "one copy_ for all layers",
    "naive": "state inside the model (use_cache=True)",
    "explicit": "explicit (K, V) pairs (return_cache=True)",
}
SHORT_LABELS = {  # the same, short enough for a bar chart's labels on a phone
    "cat": "ConcatCache", "slice": "WindowCache", "ring": "RingCache", "grow_linear": "Growable, linear",
    "grow_double": "Growable, doubling", "bare_cat": "bare torch.cat", "bare_slice": "bare copy_",
    "fused_slice": "one copy_, all layers",
}

PRESET_COLORS = {"gpt2-124m": COLOURS[0], "small": COLOURS[1], "tiny": COLOURS[2], "micro": COLOURS[3]}
KIND_MARKERS = {"prefill": "o", "decode": "s", "uncached": "^"}
SERIES = COLOURS[:5]
TARGET = COLOURS[1]  # a target's line


def _plain(ax: Axes, axis: str = "both", base: float = 10, most: int = 12) -> None:
    """Label log axes with plain numbers (1, 2, 5 or 1, 2, 4), at most `most` ticks; call after plotting."""
    fmt = FuncFormatter(lambda v, _: f"{v:,.6g}")
    for name in ("x", "y") if axis == "both" else (axis,):
        a = getattr(ax, f"{name}axis")
        lo, hi = sorted(getattr(ax, f"get_{name}lim")())
        decades = math.log10(hi / lo) if lo > 0 else 99
        subs = (1.0, 2.0, 5.0) if base == 10 and decades <= 2 else (1.0,)  # 2 and 5 too on two decades or less
        a.set_major_locator(LogLocator(base=base, subs=subs, numticks=most))
        a.set_major_formatter(fmt)
        a.set_minor_formatter(NullFormatter())


def _below(fig: Figure) -> Figure:
    """Put the figure's legend below its axes, where it hides nothing, and return the figure."""
    fig.legend(loc="outside lower center", ncol=2)
    return fig


def _calls(ax: Axes, values: dict, xy, hollow: bool = False, **legend) -> None:
    """Each timed call at `xy(call)`, and a key: colour by preset, marker by kind (`hollow`: open if overhead-bound)."""
    for preset, run in values["roofline"].items():
        for p in run["points"]:
            mfc = "none" if hollow and p["predicted"]["bound"] == "overhead" else None
            ax.plot(*xy(p), KIND_MARKERS[p["kind"]], color=PRESET_COLORS.get(preset, COLOURS[5]), mfc=mfc, ms=6)
    handles = [Line2D([], [], color=c, marker="o", ls="none", label=name)
               for name, c in PRESET_COLORS.items() if name in values["roofline"]]
    handles += [Line2D([], [], color=INK, marker=mk, ls="none", label=kind) for kind, mk in KIND_MARKERS.items()]
    ax.legend(handles=handles, ncol=2, **legend)


def plot_roofline(values: dict) -> Figure:
    """The roofline: achieved FLOP/s against arithmetic intensity, every timed call of every preset on it."""
    m = values["roofline_machine"]["wall"]
    peak, bw = m["peak_flops_per_s"], m["bandwidth_bytes_per_s"]
    fig, ax = figure(height=4.2)
    pts = [p for run in values["roofline"].values() for p in run["points"]]
    lo = min(p["intensity"] for p in pts) / 2
    hi = max(max(p["intensity"] for p in pts) * 2, 4 * peak / bw)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, bw * x) / 1e9 for x in xs], color=INK, lw=2)
    _calls(ax, values, lambda p: (p["intensity"], p["flops"] / p["step_s"] / 1e9), hollow=True, loc="lower right",
           title="open: overhead-bound")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte)", ylabel="GFLOP/s achieved",
           title=f"peak {peak / 1e9:.3g} GFLOP/s, bandwidth {bw / 1e9:.3g} GB/s")
    _plain(ax, most=7)
    return fig


def _goal(values: dict, name: str) -> float:
    """The number of the record's target `name`, or where there is none of that name, of the first of its family
    (`compiled_near_floor` for `compiled_near_floor_{preset}`)."""
    goals = {t["name"]: float(t["target"]) for t in values["targets"]}
    return goals[name] if name in goals else next(g for n, g in goals.items() if n.startswith(name + "_"))


def plot_roofline_fit(values: dict) -> Figure:
    """Measured seconds against the roofline's prediction for every timed call, with the target's band."""
    tolerance = _goal(values, "roofline_prediction")
    fig, ax = figure(height=4.2)
    pts = [p for run in values["roofline"].values() for p in run["points"]]
    lo = min(min(p["step_s"], p["predicted"]["seconds"]) for p in pts) * 1e3 / 2
    hi = max(max(p["step_s"], p["predicted"]["seconds"]) for p in pts) * 1e3 * 2
    ax.fill_between([lo, hi], [lo / tolerance, hi / tolerance], [lo * tolerance, hi * tolerance], color=INK,
                    alpha=0.15, lw=0, label=f"within {tolerance}x")
    ax.plot([lo, hi], [lo, hi], color=INK, lw=1)
    _calls(ax, values, lambda p: (p["predicted"]["seconds"] * 1e3, p["step_s"] * 1e3), loc="upper left")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted ms per call",
           ylabel="measured ms per call")
    _plain(ax, most=7)
    return fig


def plot_batch(values: dict) -> Figure:
    """Decode tokens per second against the batch size, measured (points) and predicted (lines), a panel a preset."""
    runs = values["batch"]
    fig, axes = figure(len(runs), 1, height=2.3 * len(runs) + 0.6, sharex=True, squeeze=False)
    for ax, (preset, res) in zip(axes[:, 0], runs.items(), strict=True):
        for run, color in zip(res["runs"], SERIES, strict=False):
            b = run["batch"]
            ax.plot(b, run["tokens_per_s"], "o", color=color, label=f"S = {run['s_cached']}")
            ax.plot(b, run["predicted"]["tokens_per_s"], "-", color=color)
            if "plain" in run:  # the same roofline with one bandwidth for every byte
                ax.plot(b, run["plain"]["tokens_per_s"], "--", color=color, lw=1.0, alpha=0.7)
            crit = float(run["critical_batch"])  # JSON stores infinity as the string "inf"
            if b[0] <= crit <= b[-1]:
                ax.axvline(crit, color=color, ls=":", lw=1.2)
        dashed = "; dashed: one bandwidth" if any("plain" in run for run in res["runs"]) else ""
        ax.set(xscale="log", yscale="log", ylabel="tokens / s", title=preset + dashed)
        _plain(ax, "x", base=2)
        _plain(ax, "y", most=5)
        ax.legend(loc="upper left")  # each panel has its own cached lengths
    axes[-1][0].set_xlabel("batch size B")
    return fig


def plot_critical_batch(values: dict, preset: str | None = None) -> Figure:
    """The batch from which a decode step is compute-bound, against the cached length, for MHA, GQA and MQA."""
    preset = preset or next(reversed(values["batch"]))
    curve = values["batch"][preset]["curve"]
    fig, ax = figure(height=3.8)
    h = values["batch"][preset]["preset_config"]["n_heads"]
    dotted = False  # a limit within the plotted lengths, drawn as a dotted line
    for (hkv, c), color in zip(curve["n_kv_heads"].items(), SERIES, strict=False):
        name = "MHA" if int(hkv) == h else ("MQA" if int(hkv) == 1 else "GQA")
        ys = [float(v) if float(v) != math.inf else math.nan for v in c["critical_batch"]]  # inf: not drawn
        ax.plot(curve["contexts"], ys, color=color, label=f"{name}, Hkv = {hkv}")
        limit = float(c["context_limit"])
        if limit < curve["contexts"][-1]:
            ax.axvline(limit, color=color, ls=":", lw=1.2)
            dotted = True
    ax.axhline(float(curve["weights_critical_batch"]), color=INK, ls="--", lw=1, label="weights alone")
    ax.set(yscale="log", xlabel="cached length S", ylabel="compute-bound from B",
           title=f"{preset}; dotted: no batch is compute-bound beyond" if dotted else preset)
    _plain(ax, "y")
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.legend(loc="upper left")
    return fig


def plot_concurrency(values: dict) -> Figure:
    """Sequences that fit in the memory budget against their length: layouts (top) and formats (bottom)."""
    sw = values["memory"]["sweep"]
    fig, (top, bottom) = figure(2, 1, height=5.6, sharex=True, sharey=True)
    for layout, color in zip(("MHA", "GQA", "MQA"), SERIES, strict=False):
        top.plot(sw["lengths"], sw["paged"][f"{layout}/float32"], color=color, label=f"{layout}, paged")
    top.axhline(sw["plain"]["MHA/float32"], color=SERIES[0], ls="--", lw=1.2, label="MHA, plain")
    for fmt, color in zip(("float32", "bfloat16", "int8"), SERIES, strict=False):
        bottom.plot(sw["lengths"], sw["paged"][f"MHA/{fmt}"], color=color, label=f"{fmt}, paged")
    bottom.axhline(sw["plain"]["MHA/int8"], color=SERIES[2], ls="--", lw=1.2, label="int8, plain")
    top.set(yscale="log", ylabel="sequences", title="float32, by layout")
    bottom.set(yscale="log", xlabel="tokens per sequence", ylabel="sequences", title="MHA, by format")
    for ax in (top, bottom):
        _plain(ax, "y")
        ax.legend(loc="upper right", ncol=2)
    return fig


FLOOR_OPS_LABELS = {"model": "tensor operations only", "lean": "lean step"}  # the steps of floor_ops, as named


def plot_floor_ops(values: dict) -> Figure:
    """Bandwidth each kind of operation of a decode step achieves, in the step reduced to the model's tensor
    operations (the record's "model") and in the lean step."""
    ops = values["floor_ops"]
    names = [k for k in ("q/k/v projections", "output projection", "MLP up", "MLP down", "head", "attention")
             if k in ops["model"]["operations"]]
    short = {"q/k/v projections": "q/k/v proj.", "output projection": "output proj."}
    fig, ax = figure(height=4.2)
    ys = range(len(names))
    for i, (key, label) in enumerate(FLOOR_OPS_LABELS.items()):
        ax.barh([y + 0.4 * i for y in ys], [ops[key]["operations"][k]["bytes_per_s"] / 1e9 for k in names], 0.4,
                color=SERIES[i], label=label)
    ax.axvline(ops["bandwidth"]["wall"] / 1e9, color=INK, ls="--", label="streaming bandwidth")
    ax.set_yticks([y + 0.2 for y in ys], [short.get(k, k) for k in names])
    ax.invert_yaxis()
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.set(xlabel="GB/s achieved", title=f"{ops['preset']} decode step at position {ops['model']['position']}")
    return _below(fig)


def plot_window_vs_concat(values: dict) -> Figure:
    """Decode step time with the window cache and the concatenating cache against the cached length (median, IQR)."""
    wc = values["window_vs_concat"]
    fig, ax = figure(height=3.4)
    for name, color in zip(("window", "cat"), SERIES, strict=False):
        ax.plot(wc["keys"], [t * 1e3 for t in wc[f"{name}_s"]], "o-", color=color, label=LABELS[name])
        ax.fill_between(wc["keys"], [q[0] * 1e3 for q in wc[f"{name}_q"]], [q[1] * 1e3 for q in wc[f"{name}_q"]],
                        color=color, alpha=0.2, lw=0)
    ax.set(xlabel="keys attended to", ylabel="ms per decode step", ylim=(0, None))
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.legend(loc="lower right")
    return fig


def plot_floor_ratio(values: dict) -> Figure:
    """Decode step time over the bandwidth floor against the position, for each variant of the step recorded."""
    target = _goal(values, "decode_near_floor")
    res = values["compiled"]["runs"][values["floor_ops"]["preset"]]
    fig, ax = figure(height=3.8)
    shown = (("eager model", "the model"), ("products only", "its tensor operations only"), ("lean", "lean step"),
             ("compiled", "compiled step"))
    for (name, label), color, marker in zip(shown, SERIES[:1] + SERIES[2:], "osd^", strict=False):  # 1: the target
        if name in res["variants"]:
            ax.plot(res["positions"], res["variants"][name]["over_floor"], marker + "-", color=color, label=label)
    ax.axhline(target, color=TARGET, ls="--", lw=1.2, label=f"target {target}x")
    ax.axhline(1.0, color=INK, lw=1)
    ax.set(xlabel="position of the new token", ylabel="step time / floor", ylim=(0.9, None))
    ax.xaxis.set_major_locator(MaxNLocator(6))
    return _below(fig)


def plot_compiled(values: dict) -> Figure:
    """The decode step over its floor at every preset (its worst position), for each variant every preset has."""
    target = _goal(values, "compiled_near_floor")
    runs = values["compiled"]["runs"]
    presets = list(runs)
    names = [n for n in ("eager model", "fused eager", "compiled unpacked", "compiled")
             if all(n in r["variants"] for r in runs.values())]
    fig, ax = figure(height=1.2 + 0.9 * len(presets))
    h = 0.8 / len(names)
    for i, (name, color) in enumerate(zip(names, SERIES, strict=False)):
        y = [k + (i - (len(names) - 1) / 2) * h for k in range(len(presets))]
        ax.barh(y, [max(runs[p]["variants"][name]["over_floor"]) for p in presets], height=h * 0.9, color=color,
                label={"eager model": "the model, eager", "compiled unpacked": "compiled, weights as stored",
                       "compiled": "compiled, weights packed"}.get(name, name))
    ax.axvline(target, color=TARGET, ls="--", lw=1.2, label=f"target {target}x")
    ax.axvline(1.0, color=INK, lw=1)
    ax.set(xscale="log", xlabel="step time / floor (worst position)", yticks=range(len(presets)),
           yticklabels=presets)
    ax.invert_yaxis()
    _plain(ax, "x")
    ax.grid(False, axis="y")
    return _below(fig)


def plot_rows(values: dict) -> Figure:
    """FLOP/s of products with R rows through one weight, against the roofline at their intensity: the soft ridge."""
    mach = values["roofline_machine"]
    rows = mach["rows"]
    fig, ax = figure(height=4.4)
    r = [x["rows"] for x in rows]
    # One thread: the two clocks often agree, so CPU time is drawn wider, dotted and open, to show beneath the wall's.
    for clock, key, color, label, line, lw, mfc, ms in (
            ("wall", "flops_per_s", SERIES[0], "wall clock", "-", 1.4, None, 5),
            ("cpu", "cpu_flops_per_s", SERIES[1], "CPU time", ":", 3.0, "none", 10)):
        peak, bw = mach[clock]["peak_flops_per_s"], mach[clock]["bandwidth_bytes_per_s"]
        ax.plot(r, [min(peak, bw * x["intensity"]) / 1e9 for x in rows], line, color=color, lw=lw,
                label=f"roofline, {label}", zorder=2 if clock == "wall" else 1)
        ax.plot(r, [x[key] / 1e9 for x in rows], "o", color=color, mfc=mfc, ms=ms, mew=1.6,
                label=f"measured, {label}", zorder=3)
    from labcode.bench.roofline import machine_of  # imports torch: only this figure needs it

    wall = machine_of(mach)
    if wall.row_ceilings:  # what the model allows such a product: its ceiling peak(R), or the bandwidth
        model = [min(wall.peak_for(x["rows"]), wall.bandwidth_bytes_per_s * x["intensity"]) / 1e9 for x in rows]
        ax.plot(r, model, "--", color=INK, lw=1.4, label="the model, wall clock")
    ax.set(xscale="log", yscale="log", xlabel="rows R multiplied by the weight", ylabel="GFLOP/s")
    _plain(ax, "x", base=2)
    _plain(ax, "y")
    return _below(fig)


def plot_stream_ceilings(values: dict, preset: str | None = None) -> Figure:
    """GB/s at which each weight shape, and the keys and values, streamed in the batch sweep's steps, against B."""
    preset = preset or next(reversed(values["batch"]))
    run = values["batch"][preset]["runs"][0]
    fig, ax = figure(height=3.9)
    names = list(dict.fromkeys(k for c in run["ceilings"] for k in c))
    for name, color, marker in zip(names, SERIES + COLOURS, "osD^v<>p", strict=False):
        pts = [(b, c[name] / 1e9) for b, c in zip(run["batch"], run["ceilings"], strict=True) if name in c]
        label = "keys and values" if name == "K/V" else "weight " + name.replace("x", " x ")
        ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=label, lw=1.4)
    ax.axhline(values["roofline_machine"]["wall"]["bandwidth_bytes_per_s"] / 1e9, color=INK, ls="--", lw=1.2)
    ax.set(xscale="log", xlabel="batch size B (rows per product)", ylabel="GB/s", xlim=(run["batch"][0] / 1.2,
           run["batch"][-1] * 1.2), title=f"{preset}, S = {run['s_cached']}; dashed: the bandwidth")
    _plain(ax, "x", base=2)
    ax.set_ylim(bottom=0)
    return _below(fig) if names else fig


def plot_overhead_crossover(values: dict) -> Figure:
    """A batch-1 decode step's predicted time for bytes and for its operations' fixed cost against the model width."""
    cross = values["roofline_summary"]["crossover"]
    fig, ax = figure(height=4.4)
    for (preset, c), color in zip(cross.items(), SERIES, strict=False):
        color = PRESET_COLORS.get(preset, color)
        widths = [r["d_model"] for r in c["widths"]]
        ax.plot(widths, [r["t_parts"] * 1e3 for r in c["widths"]], "-", color=color, label=f"{preset}: bytes")
        ax.plot(widths, [r["t_overhead"] * 1e3 for r in c["widths"]], "--", color=color, lw=1.4,
                label=f"{preset}: operations")
        own = values["roofline"].get(preset, {}).get("config", {}).get("d_model")
        mine = [r for r in c["widths"] if r["d_model"] == own]
        if mine:
            ax.plot(own, mine[0]["t_parts"] * 1e3, "o", color=color, ms=7)
    ax.set(xscale="log", yscale="log", xlabel="model width C (dots: the preset's own)", ylabel="ms per decode step")
    _plain(ax, "x", base=2, most=7)
    _plain(ax, "y")
    return _below(fig)


def plot_latency_throughput(values: dict, preset: str | None = None) -> Figure:
    """Latency against throughput, measured (points, labelled with the batch size) and predicted, per cached length."""
    preset = preset or next(reversed(values["batch"]))
    runs = values["batch"][preset]["runs"]
    fig, ax = figure(height=4.6)
    longest_s = max(r["s_cached"] for r in runs)
    for run, color in zip(runs, SERIES, strict=False):
        ax.plot(run["predicted"]["tokens_per_s"], [t * 1e3 for t in run["predicted"]["step_s"]], "-", color=color,
                label=f"S = {run['s_cached']}, predicted")
        ax.plot(run["tokens_per_s"], [t * 1e3 for t in run["step_s"]], "o", color=color,
                label=f"S = {run['s_cached']}, measured")
        # The longer cache's points lie up and to the left of the shorter one's (slower, fewer tokens per
        # second): its labels go further up-left, the other's down-right, so no two labels meet.
        longest = run["s_cached"] == longest_s
        offset = (-6, 6) if longest else (6, -6)
        align = {"ha": "right", "va": "bottom"} if longest else {"ha": "left", "va": "top"}
        for b, x, t in zip(run["batch"], run["tokens_per_s"], run["step_s"], strict=True):
            ax.annotate(f"{b}", (x, t * 1e3), textcoords="offset points", xytext=offset, color=color, **align)
    ax.set(xscale="log", yscale="log", xlabel="throughput: tokens per second, whole batch",
           ylabel="latency: ms per step", title=f"{preset}; numbers: batch size B")
    ax.margins(y=0.12)  # room above the highest label, below the title
    _plain(ax, most=7)
    return _below(fig)


def plot_append_medians(values: dict) -> Figure:
    """Median µs to append one position to every layer, for each cache and bare operation, in the two setups (the
    legend gives the cache lengths each setup's timed steps went through)."""
    runs = values["append"]
    kinds = list(next(iter(runs.values()))["median_step_s"])
    fig, ax = figure(height=5.4)
    height = 0.8 / len(runs)
    for i, (run, color) in enumerate(zip(runs.values(), SERIES, strict=False)):
        ax.barh([k + i * height for k in range(len(kinds))], [run["median_step_s"][k] * US for k in kinds], height,
                color=color, label=f"{run['cache_length'][0]:,} to {run['cache_length'][-1]:,} positions cached")
    ax.set_yticks([k + height * (len(runs) - 1) / 2 for k in range(len(kinds))],
                  [SHORT_LABELS.get(k, LABELS.get(k, k)) for k in kinds])
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="µs per decode step, all layers (median)")
    _plain(ax, "x")
    return _below(fig)


PLOTS = {  # a figure's name (its file is bench_NAME.png) and the function that draws it
    "roofline": plot_roofline, "roofline_fit": plot_roofline_fit, "rows": plot_rows, "batch": plot_batch,
    "stream_ceilings": plot_stream_ceilings, "critical_batch": plot_critical_batch, "concurrency": plot_concurrency,
    "floor_ops": plot_floor_ops, "floor_ratio": plot_floor_ratio, "window_vs_concat": plot_window_vs_concat,
    "overhead_crossover": plot_overhead_crossover, "latency_throughput": plot_latency_throughput,
    "append_medians": plot_append_medians, "compiled": plot_compiled,
}


def save_plots(values: dict, directory: str | Path) -> list[Path]:
    """Draw every figure into `directory` as PNG files; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in PLOTS.items():
        fig = draw(values)
        paths.append(directory / f"bench_{name}.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths
