"""CLI: simulate a schedule and print its bubble table next to the closed form.

    python -m dualpipe.simulate --schedule dualpipe --ranks 8 --microbatches 20 [--vpp 2] \\
        [--csv out.csv] [--trace out.json] [--png out.png] [--F 1 --B 2 --W 1 --FB 3 --p2p 0]
"""

from __future__ import annotations

import sys

from accel.cli import ArgumentParser, check_output_file, nonnegative_float, positive_int
from dualpipe.calculator import closed_form
from dualpipe.schedules import SCHEDULES, build
from dualpipe.simulator import Costs, simulate
from dualpipe.timeline import write_png, write_trace
from dualpipe.validate import validate


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dualpipe.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=SCHEDULES, default="dualpipe", help="pipeline schedule to simulate")
    p.add_argument("--ranks", type=positive_int, default=8, help="pipeline ranks (devices)")
    p.add_argument("--microbatches", type=positive_int, default=20, help="micro-batches per step")
    p.add_argument("--vpp", type=positive_int, default=1,
                   help="model chunks per rank (interleaved1f1b only, >= 2; costs are then one chunk's)")
    p.add_argument("--F", type=nonnegative_float, default=1.0, help="forward cost")
    p.add_argument("--B", type=nonnegative_float, default=2.0, help="full backward cost")
    p.add_argument("--W", type=nonnegative_float, default=1.0, help="weight-gradient cost (I = B - W)")
    p.add_argument("--FB", type=nonnegative_float, default=None,
                   help="overlapped forward+backward cost (default F+B)")
    p.add_argument("--p2p", type=nonnegative_float, default=0.0, help="latency of one P2P message")
    p.add_argument("--csv", help="write the schedule (torch.distributed.pipelining notation)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--png", help="write a timeline PNG")
    args = p.parse_args(argv)
    try:
        for option, path in (("--csv", args.csv), ("--trace", args.trace), ("--png", args.png)):
            if path:
                check_output_file(path, option)
        sched = build(args.schedule, args.ranks, args.microbatches, args.vpp)
        costs = Costs(F=args.F, B=args.B, W=args.W, FB=args.FB, p2p=args.p2p)
    except ValueError as exc:
        p.error(str(exc))
    validate(sched)
    result = simulate(sched, costs)
    cf = closed_form(args.schedule, args.ranks, costs, args.vpp)
    print(f"{args.schedule}: {args.ranks} ranks{f' x {args.vpp} chunks' if args.vpp > 1 else ''}, "
          f"{args.microbatches} micro-batches, costs {costs}")
    print(f"makespan {result.makespan:.4g}; closed-form bubble "
          f"{'n/a' if cf is None else f'{cf.bubble:.4g}'}, parameters "
          f"{'n/a' if cf is None else f'{cf.parameters}x'}, activations {'n/a' if cf is None else cf.activations}")
    print(f"{'rank':>4} {'busy':>8} {'bubble':>8} {'peak act':>8} {'params':>6}")
    for r in range(args.ranks):
        print(f"{r:>4} {result.busy(r):>8.4g} {result.bubble(r):>8.4g} {result.peak_activations(r):>8} "
              f"{result.parameters(r):>5}x")
    if args.csv:
        sched.save_csv(args.csv)
    if args.trace:
        write_trace(result, args.trace)
    if args.png:
        write_png(result, args.png)
    for label, path in (("csv", args.csv), ("trace", args.trace), ("png", args.png)):
        if path:
            print(f"wrote {label}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
