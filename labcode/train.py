"""Deterministic training of the shipped tiny checkpoint.

Introduced in chapter 1. Run `python -m labcode.train` to rebuild
`labcode/data/tiny.pt` from the generated corpus: same seed, same bytes.
`python -m labcode.train --model draft` rebuilds `labcode/data/draft.pt`, the tinier model that
chapter 12 uses as a speculative draft. `--model cla` and `--model gqa` rebuild the two variants of the
tiny model that chapter 13 compares, each with half its cache: cross-layer attention (its second layer
attends to the first layer's keys and values) and grouped-query attention (two key/value heads of four).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from labcode.config import DRAFT_CONFIG, GPTConfig, get_config
from labcode.corpus import make_corpus
from labcode.model import GPT
from labcode.tokenizer import CharTokenizer
from labcode.weights.checkpoint import (
    CLA_CHECKPOINT,
    DEFAULT_CHECKPOINT,
    DRAFT_CHECKPOINT,
    GQA_CHECKPOINT,
    save_checkpoint,
)

MODELS = {
    "tiny": (get_config("tiny"), DEFAULT_CHECKPOINT),
    "draft": (DRAFT_CONFIG, DRAFT_CHECKPOINT),
    "cla": (get_config("tiny", kv_share=2), CLA_CHECKPOINT),  # chapter 13: one K/V layer for both layers
    "gqa": (get_config("tiny", n_kv_heads=2), GQA_CHECKPOINT),  # chapter 13: the same bytes, by fewer heads
}


def train(cfg: GPTConfig, steps: int = 1500, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
          log_every: int = 0) -> tuple[GPT, list[float]]:
    """Train a fresh model on the generated corpus with one thread and a fixed seed; return it and its losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count: pin it for reproducible bytes
    # Weight init and dropout draw from the global generator: seed it, and leave the caller's untouched.
    # Training needs autograd even when the caller turned it off for inference.
    with torch.random.fork_rng(), torch.enable_grad():
        torch.manual_seed(seed)
        try:
            return _train(cfg, steps, batch_size, lr, seed, log_every)
        finally:
            torch.set_num_threads(threads)


def _train(cfg: GPTConfig, steps: int, batch_size: int, lr: float, seed: int,
           log_every: int) -> tuple[GPT, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(CharTokenizer().encode(make_corpus(seed=seed)), dtype=torch.long)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - cfg.context_length, (batch_size,), generator=gen)  # every start
        x = torch.stack([data[s : s + cfg.context_length] for s in starts])  # (B, T)
        y = torch.stack([data[s + 1 : s + cfg.context_length + 1] for s in starts])
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}")
    return model.eval(), losses


def heldout_batch(n: int, seed: int = 1, n_stories: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [rows, n] of `heldout_loss`: consecutive windows of n tokens of a corpus of
    `n_stories` generated with `seed`, each target the next token."""
    data = torch.tensor(CharTokenizer().encode(make_corpus(n_stories=n_stories, seed=seed)), dtype=torch.long)
    rows = (len(data) - 1) // n
    return data[: rows * n].view(rows, n), data[1 : rows * n + 1].view(rows, n)


def heldout_loss(model: GPT, seed: int = 1, n_stories: int = 100, cache_for=None) -> float:
    """Mean next-token loss (nats) of `model` on a corpus it was not trained on (another seed of the same
    generator), over consecutive windows of its context length, in float64; through a fresh cache
    `cache_for(model)` if given (chapter 13 scores a cache that changes the logits)."""
    x, y = (t.to(model.device) for t in heldout_batch(model.cfg.context_length, seed, n_stories))
    with torch.no_grad():
        logits = (model(x) if cache_for is None else model(x, cache_for(model))).double()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, model.cfg.vocab_size), y.reshape(-1)).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one of the course's checkpoints deterministically.")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: labcode/data/<model>.pt")
    args = parser.parse_args(argv)
    cfg, default_out = MODELS[args.model]
    out = args.out or default_out
    start = time.perf_counter()
    model, losses = train(cfg, steps=args.steps, seed=args.seed, log_every=100)
    seconds = time.perf_counter() - start  # one thread; a record of this machine, not a property of the model
    meta = {"model": args.model, "steps": args.steps, "seed": args.seed, "final_loss": losses[-1],
            "train_seconds": round(seconds, 1)}
    save_checkpoint(model, out, meta=meta)
    print(f"wrote {out} (final loss {losses[-1]:.4f}, trained in {seconds:.0f} s)")


if __name__ == "__main__":
    main()
