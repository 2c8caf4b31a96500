"""Figures of a benchmark result (the `values` of its JSON file), drawn with matplotlib.

Introduced in chapter 7. Every function takes the plain dictionaries the JSON holds,
so a committed result file can be plotted again without running anything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

US, MS = 1e6, 1e3
LABELS = {  # every contender of the append and generation benchmarks
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
VARIANT_COLORS = ("tab:orange", "tab:green", "tab:purple", "tab:brown")  # the floor plot's variants, in order


def _log_panels(runs: dict, draw: Callable[[Axes, str, dict], None]) -> Figure:
    """One log-scale panel per run, filled by `draw(ax, name, run)`, and one legend right of the last."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        draw(ax, name, run)
        ax.set(yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def plot_append(values: dict) -> Figure:
    """Per-step time of appending one position to every layer, against the cache length, one panel per setup."""

    def draw(ax: Axes, name: str, res: dict) -> None:
        for kind, ts in res["per_step_s"].items():
            ax.plot(res["cache_length"], [t * US for t in ts], label=LABELS.get(kind, kind), lw=1.2)
        s = res["setup"]
        ax.set(xlabel="keys cached after the step", ylabel="µs per decode step (all layers)",
               title=f"{name}: L={s['n_layers']}, Hkv={s['n_kv_heads']}, D={s['head_dim']}, prefill {s['prefill']}")

    return _log_panels(values["append"], draw)


def plot_append_attention(values: dict) -> Figure:
    """Median time of append plus one-token attention per decode step, for each cache and attention method."""
    res = values["append_attention"]
    combos = list(res["median_step_s"])
    caches = sorted({c.split("/")[0] for c in combos}, key=[c.split("/")[0] for c in combos].index)
    methods = sorted({c.split("/")[1] for c in combos}, key=[c.split("/")[1] for c in combos].index)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(caches))]
        ax.bar(xs, [res["median_step_s"][f"{c}/{m}"] * MS for c in caches], width, label=m)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(caches))],
                  [LABELS.get(c, c) for c in caches])
    ax.set(ylabel="ms per decode step (all layers)", title="append + single-token attention")
    ax.legend(title="attention")
    fig.tight_layout()
    return fig


def plot_generation(values: dict) -> Figure:
    """Per-call time of greedy generation against the context length, one panel per model preset."""

    def draw(ax: Axes, preset: str, res: dict) -> None:
        for m, ts in res["per_step_s"].items():
            style = {"lw": 2.0, "color": "black"} if m == "nocache" else {"lw": 1.0}
            ax.plot(res["positions"][1:], [t * MS for t in ts[1:]], label=LABELS.get(m, m), **style)
        ax.set(xlabel="tokens in the context", ylabel="ms per generated token",
               title=f"{preset}: prompt {res['prompt_len']}, {res['new_tokens']} new tokens")

    return _log_panels(values["generation"], draw)


def plot_speedup(values: dict) -> Figure:
    """Measured speedup of each cache over no cache, next to the speedup the FLOP count predicts."""
    runs = values["generation"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, (preset, res) in zip(axes[0], runs.items(), strict=True):
        methods = [m for m in res["speedup"] if m != "nocache"]
        ax.barh(methods, [res["speedup"][m] for m in methods], color="tab:blue", label="measured")
        ax.axvline(res["predicted_speedup"], color="tab:red", ls="--", label="FLOP-count prediction")
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="speedup over no cache (total time)", title=preset,
               xlim=(0.5, 2 * max(res["predicted_speedup"], *res["speedup"].values())))
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_floor(values: dict, target: float = 1.3) -> Figure:
    """Cached decode step time against the memory-bandwidth floor, across positions: wall clock and CPU time."""
    res = values["floor"]
    clocks = [("", "wall clock")] + ([("_cpu", "process CPU time")] if "ratio_cpu" in res else [])
    fig, axes = plt.subplots(2, len(clocks), figsize=(6 * len(clocks), 5.5), sharex=True, squeeze=False)
    x = res["positions"]
    for col, (suffix, clock) in enumerate(clocks):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(x, [t * MS for t in res[f"step{suffix}_s"]], "o-", label="measured decode step")
        for (name, var), color in zip(res.get("variants", {}).items(), VARIANT_COLORS, strict=False):
            top.plot(x, [t * MS for t in var[f"step{suffix}_s"]], "x:", color=color, label=f"same model, {name}")
        top.plot(x, [t * MS for t in res[f"floor{suffix}_s"]], "s--", color="black", label="floor: bytes / bandwidth")
        top.set(ylabel="ms per step", ylim=(0, None), title=f"{res.get('preset', '')} decode, {clock}")
        bottom.plot(x, res[f"ratio{suffix}"], "o-", color="tab:blue", label="model")
        for (name, var), color in zip(res.get("variants", {}).items(), VARIANT_COLORS, strict=False):
            bottom.plot(x, var[f"ratio{suffix}"], "x:", color=color, label=name)
        bottom.axhline(target, color="tab:red", ls="--", label=f"target {target}x")
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set(xlabel="position of the new token", ylabel="measured / floor", ylim=(0.8, None))
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOTS = {
    "append": plot_append,
    "append_attention": plot_append_attention,
    "generation": plot_generation,
    "speedup": plot_speedup,
    "floor": plot_floor,
}


def save_plots(values: dict, directory: str | Path) -> list[Path]:
    """Draw every figure into `directory` as PNG files; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in PLOTS.items():
        fig = draw(values)
        path = directory / f"bench_{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
