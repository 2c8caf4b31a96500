"""Command line: run a chapter-10 job and compare it with one process.

    python -m labcode.distributed tp --nproc 4            # starts 4 processes itself
    torchrun --nproc-per-node 2 -m labcode.distributed pp  # or let torchrun start them

Jobs: `tp` (tensor parallel), `pp` (pipeline), `disagg` (prefill in one process, decode in another),
`hello` (an all-reduce). Started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set),
each process joins torchrun's group; otherwise this process starts `--nproc` processes on loopback.
Prints one JSON line (from rank 0 under torchrun) and exits 0 when the job matches one process.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from labcode.config import get_config
from labcode.distributed import jobs, verify
from labcode.distributed.launch import join_from_env, launch, torchrun_world
from labcode.model import GPT
from labcode.tokenizer import CharTokenizer
from labcode.weights.checkpoint import load_checkpoint


def build_model(args) -> GPT:
    """The shipped checkpoint, or a seeded random model when --kv-heads or --layers asks for another shape."""
    dtype = getattr(torch, args.dtype)
    if args.kv_heads is None and args.layers is None:
        return load_checkpoint(device="cpu", dtype=dtype)
    changes = {k: v for k, v in (("n_kv_heads", args.kv_heads), ("n_layers", args.layers)) if v is not None}
    torch.manual_seed(args.seed)
    return GPT(get_config("tiny", rotary=args.rotary, **changes)).to(dtype).eval()


def job_and_args(args, model: GPT, ids: torch.Tensor):
    schedules = [[ids.shape[1]], args.chunks]
    if args.job == "tp":
        return jobs.tp_job, (model, ids, schedules, args.steps)
    if args.job == "pp":
        return jobs.pp_job, (model, ids, schedules, args.steps)
    if args.job == "disagg":
        return jobs.disagg_job, (model, ids, args.steps, args.kind)
    return jobs.hello_job, ()


def summary(args, model: GPT, ids: torch.Tensor, results: list) -> dict:
    """What the job computed against one process, and whether it passed."""
    schedules = [[ids.shape[1]], args.chunks]
    if args.job == "hello":
        world = len(results)
        out = {"sums": [r["sum"] for r in results]}
        return {"job": "hello", **out, "passed": all(s == world * (world + 1) / 2 for s in out["sums"])}
    if args.job == "tp":
        out = verify.verify_tp(model, ids, schedules, args.steps, results)
    elif args.job == "pp":
        out = verify.verify_pp(model, ids, schedules, args.steps, results)
    else:
        out = verify.verify_disagg(model, ids, args.steps, args.kind, results)
    passed = "refused" not in out and out["max_abs_logit_diff"] <= args.tolerance and out["tokens_equal"]
    return {"job": args.job, **out, "passed": bool(passed)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m labcode.distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["tp", "pp", "disagg", "hello"])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--prompt", default="The sleepy fox walked", help="the prompt, as text")
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="a second request's prefill chunk sizes, e.g. 8,7,6 (default: halves)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps after the prompt")
    parser.add_argument("--kind", default="contiguous", choices=["contiguous", "window", "paged"],
                        help="the cache shipped by disagg")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--kv-heads", type=int, default=None, help="a random model with this many key/value heads")
    parser.add_argument("--layers", type=int, default=None, help="a random model with this many layers")
    parser.add_argument("--rotary", action="store_true", help="rotary positions (random models only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before the job is stopped")
    args = parser.parse_args(argv)
    args.tolerance = 1e-12 if args.dtype == "float64" else 1e-4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)  # tiny models: more threads would only contend with the job's processes
    model = build_model(args)
    ids = CharTokenizer().encode_tensor(args.prompt)  # (1, P)
    p = ids.shape[1]
    args.chunks = args.chunks or [p // 2, p - p // 2]
    fn, job_args = job_and_args(args, model, ids)
    found = torchrun_world()
    if found is None:  # start the processes here
        results = launch(fn, args.nproc, *job_args, timeout=args.timeout)
    else:  # torchrun started them: this is one of them
        rank, world = join_from_env(args.timeout)
        try:
            mine = fn(rank, world, *job_args)
            results = [None] * world
            dist.all_gather_object(results, mine)  # every rank's result, for rank 0 to compare
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    out = summary(args, model, ids, results)
    print(json.dumps(out))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
