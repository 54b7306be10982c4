"""One entry point for the kernel benchmarks: ours vs the baseline, side by side.

    python -m recipes.bench_kernels deep_gemm [args...]   # -> recipes.bench_deep_gemm.main(args)
    python -m recipes.bench_kernels flash_mla [args...]   # -> recipes.bench_flash_mla.main(args)
    python -m recipes.bench_kernels fused [args...]       # -> recipes.bench_fused.main(args)
    python -m recipes.bench_kernels all [args...]         # each in turn, with the same args

Each benchmark module owns its arguments (``... deep_gemm --help``). Exit status: the worst of the
benchmarks' own statuses; 2 when a benchmark module is missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from accel.cli import BAD_INPUT, ArgumentParser

BENCHMARKS = {"deep_gemm": "recipes.bench_deep_gemm", "flash_mla": "recipes.bench_flash_mla",
              "fused": "recipes.bench_fused"}
EXIT_MISSING = BAD_INPUT


def _run(name: str, argv: list[str]) -> int:
    module_name = BENCHMARKS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the benchmark exists but something it imports does not: show the real error
        print(f"error: bench_kernels: no {name} benchmark: module {module_name} is not in this checkout",
              file=sys.stderr)
        return EXIT_MISSING
    if not hasattr(module, "main"):
        print(f"error: bench_kernels: {module_name} has no main(argv) function", file=sys.stderr)
        return EXIT_MISSING
    status = module.main(argv)
    return int(status or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m recipes.bench_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=[*BENCHMARKS, "all"], help="which benchmark to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark's own main(argv)")
    ns = parser.parse_args(argv)
    names = list(BENCHMARKS) if ns.kernel == "all" else [ns.kernel]
    statuses = []
    for name in names:
        if len(names) > 1:
            print(f"== bench_kernels: {name} ==", flush=True)
        statuses.append(_run(name, list(ns.args)))
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main())
