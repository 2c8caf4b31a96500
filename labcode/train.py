"""Deterministic training of the shipped tiny checkpoint.

Introduced in chapter 1. Run `python -m labcode.train` to rebuild
`labcode/data/tiny.pt` from the generated corpus: same seed, same bytes.
`python -m labcode.train --model draft` rebuilds `labcode/data/draft.pt`, the tinier model that
chapter 12 uses as a speculative draft.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from labcode.config import DRAFT_CONFIG, GPTConfig, get_config
from labcode.corpus import make_corpus
from labcode.model import GPT
from labcode.tokenizer import CharTokenizer
from labcode.weights.checkpoint import DEFAULT_CHECKPOINT, DRAFT_CHECKPOINT, save_checkpoint

MODELS = {"tiny": (get_config("tiny"), DEFAULT_CHECKPOINT), "draft": (DRAFT_CONFIG, DRAFT_CHECKPOINT)}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one of the course's checkpoints deterministically.")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: labcode/data/<model>.pt")
    args = parser.parse_args(argv)
    cfg, default_out = MODELS[args.model]
    out = args.out or default_out
    model, losses = train(cfg, steps=args.steps, seed=args.seed, log_every=100)
    meta = {"model": args.model, "steps": args.steps, "seed": args.seed, "final_loss": losses[-1]}
    save_checkpoint(model, out, meta=meta)
    print(f"wrote {out} (final loss {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
