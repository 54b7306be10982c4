"""Verify every registered kernel op: compiles, correct on fresh seeds, no fall-back, faster than the reference.

    python -m recipes.verify_kernels                      # every op, its small shapes, 5 seeds
    python -m recipes.verify_kernels --ops 'deep_gemm.*' --seeds 8 --json verify.json
    python -m recipes.verify_kernels --bench-shapes       # plus the realistic GPU shapes (GPU only)
    python -m recipes.verify_kernels --ops toy.axpby --seed 123 --seed 456   # replay failing seeds

(installed as ``dsv3-verify-kernels``). On a cpu the kernels run in the Triton interpreter
(TRITON_INTERPRET=1 is set here when unset): correctness is checked, timings mean nothing.
Exit status: 0 all passed, 1 a check failed or a kernel package failed to import, 2 nothing to verify.
The checks themselves live in ``accel.verify``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_NOTHING = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv3-verify-kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", action="append", metavar="GLOB",
                   help="op names to verify, glob patterns, repeatable (default: every registered op)")
    p.add_argument("--seeds", type=int, default=5, metavar="N", help="fresh random seeds per shape (default 5)")
    p.add_argument("--seed", type=int, action="append", metavar="S",
                   help="replay exactly these seeds (repeatable; overrides --seeds)")
    p.add_argument("--bench-shapes", action="store_true",
                   help="also run each op's realistic bench_shapes (skipped on cpu: too large for the interpreter)")
    p.add_argument("--no-bench", action="store_true", help="check correctness only, no timing")
    p.add_argument("--json", metavar="PATH", help="write context, per-seed results and summary as JSON")
    p.add_argument("--list", action="store_true", help="list registered ops and what each would run now, then exit")
    p.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE",
                   help="also import MODULE (which registers more ops), repeatable")
    return p


def _literal_prefix(pattern: str) -> str:
    cut = min((i for i, ch in enumerate(pattern) if ch in "*?["), default=len(pattern))
    return pattern[:cut]


def _concerns(package: str, patterns: Sequence[str] | None) -> bool:
    """Whether ``patterns`` could select ops of ``package`` (whose ops are named ``package.*``)."""
    if patterns is None:
        return True
    name = package + "."
    return any(name.startswith(_literal_prefix(p)) or _literal_prefix(p).startswith(name) for p in patterns)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seeds < 1:
        _parser().error(f"--seeds {args.seeds}: expected at least 1")

    import accel  # imported after parsing so that --help is instant

    if accel.backend() == "cpu" and not accel.triton_interpreted():
        # Must precede the kernel packages' import: @triton.jit picks the interpreter when it decorates.
        os.environ["TRITON_INTERPRET"] = "1"
        accel.reset()
    from accel import registry, verify

    problems = []
    # Only the packages the globs can select: `--ops toy.*` neither waits for nor depends on deep_gemm.
    wanted = [pkg for pkg in registry.KERNEL_PACKAGES if args.list or _concerns(pkg, args.ops)]
    for pkg, why in registry.import_kernel_packages(wanted).items():
        if why and why != "not installed":
            problems.append(f"kernel package {pkg} failed to import: {why}")
    for module in args.modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"--import {module} failed: {type(exc).__name__}: {exc}")
    for line in problems:
        print(f"ERROR {line}", file=sys.stderr)

    registered = registry.ops()
    if args.list:
        rows = [{"op": name, "impl": info["impl"], "verify_shapes": len(registry.get(name).verify.shapes)
                 if registry.get(name).verify else 0, "reason": info["reason"]}
                for name, info in registry.report().items()]
        print(accel.report.format_table(rows) if rows else "no kernel ops are registered")
        return EXIT_FAILED if problems else EXIT_OK
    if not registered:
        print("no kernel ops are registered: nothing to verify (the kernel packages deep_gemm and flash_mla "
              "register theirs when imported; use --import MODULE for others)")
        return EXIT_FAILED if problems else EXIT_NOTHING
    names = verify.select_ops(args.ops)
    if not names:
        print(f"no registered op matches {' '.join(args.ops)}; registered: {', '.join(registered)}")
        return EXIT_FAILED if problems else EXIT_NOTHING

    bench_shapes = args.bench_shapes
    if bench_shapes and accel.backend() == "cpu":
        print("note: --bench-shapes skipped on cpu (realistic shapes are far too large for the Triton interpreter)")
        bench_shapes = False
    seeds = args.seed or args.seeds

    results = []
    extra = {"errors": problems, "argv": list(sys.argv[1:] if argv is None else argv)}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", end=" ", flush=True)
        start = time.perf_counter()
        op_results = verify.verify_op(name, seeds=seeds, bench=not args.no_bench, bench_shapes=bench_shapes)
        results += op_results
        passed = sum(r.passed for r in op_results)
        print(f"{'PASS' if passed == len(op_results) else 'FAIL'} {passed}/{len(op_results)} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        if args.json:  # after every op, so a run cut short by a timeout still leaves its results
            verify.write_json(args.json, results, extra={**extra, "complete": i == len(names)})
    print(verify.format_report(results))
    for line in problems:
        print(f"ERROR {line}")
    if args.json:
        print(f"wrote {args.json}")
    passed = all(r.passed for r in results) and not problems
    print(f"{'PASSED' if passed else 'FAILED'}: {sum(r.passed for r in results)}/{len(results)} checks "
          f"over {len(names)} ops")
    return EXIT_OK if passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
