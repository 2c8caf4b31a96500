"""Command line: `python -m labcode.bench [--quick|--full|--test] [--out FILE] [--plots DIR]`."""

from __future__ import annotations

import argparse
import sys

import torch

from labcode.bench import SIZES, run_benchmarks
from labcode.weights.checkpoint import default_device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labcode.bench", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="small sizes, about five minutes on one core, most of them compiling (the default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the sizes the book reports (15 to 25 minutes, by the CPU)")
    mode.add_argument("--test", dest="mode", action="store_const", const="test", help="tiny sizes, a few seconds")
    parser.add_argument("--out", default=None, help="result file (default: qa/results/bench.json for --full, "
                        "qa/_runs/bench_<mode>.json otherwise, so a quick run never replaces the book's numbers)")
    parser.add_argument("--plots", default=None, metavar="DIR", help="also write the figures as PNG files here")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: %(default)s; on a machine shared with other jobs, more "
                        "threads wait for each other and the timings stop meaning anything)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    mode_name = args.mode or "quick"
    assert mode_name in SIZES
    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    result = run_benchmarks(mode_name, device, progress=not args.no_progress)
    out = args.out or ("qa/results/bench.json" if mode_name == "full" else f"qa/_runs/bench_{mode_name}.json")
    path = result.write(out)
    values = result.doc["values"]
    print(f"wrote {path} ({mode_name}, {values['elapsed_s']:.1f} s, device {device}, "
          f"{torch.get_num_threads()} threads)")
    for t in values["targets"]:
        print(f"  {'met    ' if t['met'] else 'NOT met'}  {t['name']}: measured {t['measured']:.3g} "
              f"{t['comparison']} {t['target']:g}" + (f"\n             {t['reason']}" if "reason" in t else ""))
    if args.plots:
        from labcode.bench.plots import save_plots

        for p in save_plots(values, args.plots):
            print(f"  figure {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
