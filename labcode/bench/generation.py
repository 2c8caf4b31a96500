"""Greedy generation with no cache and with every cache, on whole models.

Introduced in chapter 7. Every generation runs in lockstep with the others (step i of each method, in rotating order,
before step i + 1 of any), so a change in the machine's load touches all methods alike.
"""

from __future__ import annotations

import torch

from labcode.bench.common import TIMED, Sizes, bar, random_model
from labcode.bench.timing import median, rotated, timed
from labcode.caches import ConcatCache, GrowableCache, Request, RingCache, WindowCache
from labcode.flops import generation_flops
from labcode.model import GPT
from labcode.results import QAResult

METHODS = ("nocache", "cat", "window", "ring", "grow_linear", "grow_double", "naive", "explicit")


class Runner:
    """One generation method: `start(ids)` runs the prompt, `step(token)` one new token; both return logits [B, V].
    "nocache" reruns the whole sequence; every other method is a `Request` in one of the three styles."""

    def __init__(self, model: GPT, method: str, capacity: int) -> None:
        self.model, self.method, self.ids = model, method, None
        n = model.cfg.n_layers
        caches = {"cat": lambda: ConcatCache(n), "window": lambda: WindowCache(n, capacity),
                  "ring": lambda: RingCache(n, capacity), "grow_linear": lambda: GrowableCache(n, 16, "linear"),
                  "grow_double": lambda: GrowableCache(n, 16, "double")}
        if method in caches:
            self.request = Request(model, "object", caches[method]())
        elif method != "nocache":
            self.request = Request(model, method)  # "naive" or "explicit"

    def start(self, ids: torch.Tensor) -> torch.Tensor:
        if self.method == "nocache":
            self.ids = ids
            return self.model(ids)[:, -1]
        return self.request(ids)[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.method == "nocache":
            self.ids = torch.cat((self.ids, token.unsqueeze(1)), dim=1)  # (B, P + i)
            return self.model(self.ids)[:, -1]
        return self.request(token.unsqueeze(1))[:, -1]


@torch.inference_mode()
def bench_generation(model: GPT, prompt_len: int, new_tokens: int, rounds: int, methods=METHODS,
                     seed: int = 0, progress=None) -> dict:
    """Greedy generation of `new_tokens` after a random prompt, every method in lockstep; call 0 is the prompt.
    Returns per-call median seconds, totals, tokens/s, the measured speedup of each cache over no cache and the
    FLOP-count prediction, and whether each method's tokens and logits match no cache's."""
    device, cfg = model.device, model.cfg
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen).to(device)
    methods = list(methods)
    _generate_lockstep(model, ids, min(3, new_tokens), methods, 0, None)  # warm-up
    seconds: dict[str, list[list[float]]] = {m: [] for m in methods}  # per method, per round, per call
    for r in range(rounds):
        logits, step_times = _generate_lockstep(model, ids, new_tokens, methods, r, progress)
        for m in methods:
            seconds[m].append(step_times[m])
    per_step = {m: [median(call) for call in zip(*seconds[m], strict=True)] for m in methods}
    total = {m: sum(per_step[m]) for m in methods}
    flops = {c: sum(generation_flops(cfg, prompt_len, new_tokens, cached=c)) for c in (False, True)}
    ref = logits["nocache"]
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds,
            "positions": [prompt_len + i for i in range(new_tokens)],  # tokens in the context at each call
            "per_step_s": per_step, "total_s": total, "tokens_per_s": {m: new_tokens / total[m] for m in methods},
            "speedup": {m: total["nocache"] / total[m] for m in methods}, "flops_nocache": flops[False],
            "flops_cached": flops[True], "predicted_speedup": flops[False] / flops[True],
            "ids_match": {m: bool(torch.equal(logits[m].argmax(-1), ref.argmax(-1))) for m in methods},
            "max_logit_diff": {m: float((logits[m] - ref).abs().max()) for m in methods}}


def _generate_lockstep(model: GPT, ids: torch.Tensor, n: int, methods: list[str], shift: int, progress):
    """Run all methods side by side, each feeding back its own greedy token; return logits [n, V], seconds per call."""
    runners = {m: Runner(model, m, ids.shape[1] + n) for m in methods}
    logits, step_times = {m: [] for m in methods}, {m: [] for m in methods}
    for i in range(n):
        for m in rotated(methods, i + shift):
            run = runners[m]
            if i == 0:
                fn = lambda run=run: logits[run.method].append(run.start(ids))  # noqa: E731
            else:
                token = logits[m][-1].argmax(dim=-1)  # (B,)
                fn = lambda run=run, token=token: logits[run.method].append(run.step(token))  # noqa: E731
            step_times[m].append(timed(fn, model.device))
        if progress is not None:
            progress.update(1)
    model.reset_kv_cache()
    return {m: torch.cat(v) for m, v in logits.items()}, step_times


def record(res: QAResult, sizes: Sizes, device: torch.device, models: dict, progress: bool) -> None:
    """Greedy generation with no cache and with every cache at each of `sizes.generation`; the models it built are
    left in `models` for the sections after it."""
    generation = {}
    for preset, prompt, new, rounds in sizes.generation:
        models[preset] = models.get(preset) or random_model(preset, device)
        with bar(rounds * new, f"generation {preset}", progress) as b:
            generation[preset] = bench_generation(models[preset], prompt, new, rounds, progress=b)
        generation[preset]["preset"] = preset
    res.value("generation", generation, TIMED)
