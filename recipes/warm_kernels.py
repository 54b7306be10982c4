"""Compile every deep_gemm / flash_mla kernel at every autotune config before anything is measured.

    python -m recipes.warm_kernels --jobs 16                  # on the GPU host, from the repo root
    python -m recipes.warm_kernels --areas flash_mla --jobs 5

Starts one process per (benchmark area, autotune shard), all sharing Triton's on-disk cache
(``TRITON_CACHE_DIR``): each runs the area's quick benchmark once with ``DSV3_AUTOTUNE_SHARD=i/n``
(``accel.autotune``), so it compiles its slice of every kernel's configs at the benchmark shapes, on
its own core. Afterwards a benchmark's autotuner finds each config already compiled and only times
them. Compiles with the Triton of the machine it runs on (the GPU host's own). Exit status: the number
of processes that failed (their output is printed; a failed warm-up costs time later, not results).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from accel import autotune
from accel.cli import ArgumentParser, positive_float, positive_int

AREAS = ("deep_gemm", "flash_mla")


def shard_count() -> int:
    """The longest autotune config list among the kernels: that many shards compile everything once."""
    from deep_gemm.kernels import gemm
    from flash_mla.kernels import attention, decode
    from flash_mla.kernels.common import cuda_capability

    capability = cuda_capability()  # the lists this machine's autotuners use
    lists = [gemm._dense_kernel.configs, *(decode.decode_configs(fp8, capability) for fp8 in (False, True)),
             *(autotune.for_capability(c, capability)
               for c in (attention.FWD_CONFIGS, attention.DKDV_CONFIGS, attention.DQ_CONFIGS))]
    return max(len(c) for c in lists)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m recipes.warm_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="processes at once (default: all cores)")
    p.add_argument("--areas", default=",".join(AREAS), help=f"comma-separated, from {','.join(AREAS)}")
    p.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds before the remaining processes are killed")
    args = p.parse_args(argv)
    areas = [a for a in args.areas.split(",") if a]
    unknown = set(areas) - set(AREAS)
    if unknown or not areas:
        p.error(f"--areas {args.areas!r}: expected some of {', '.join(AREAS)}, comma-separated")
    shards = shard_count()
    tasks = [(area, i) for i in range(shards) for area in areas]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "DSV3_DEEP_GEMM_CHECK_SCALES": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    print(f"warm_kernels: {len(tasks)} processes ({shards} autotune shards x {areas}), {args.jobs} at a time, "
          f"cache {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')}", flush=True)
    deadline = time.monotonic() + args.timeout
    pending, running, failed = list(tasks), {}, 0
    while pending or running:
        while pending and len(running) < args.jobs:
            area, i = pending.pop(0)
            cmd = [sys.executable, "-m", "recipes.bench_kernels", area, "--quick", "--no-baseline"]
            running[(area, i)] = (time.monotonic(), subprocess.Popen(
                cmd, cwd=root, env={**env, "DSV3_AUTOTUNE_SHARD": f"{i}/{shards}"}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        time.sleep(0.2)
        for key, (t0, proc) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0]
            del running[key]
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            print(f"warm_kernels: {key[0]} shard {key[1]}/{shards}: {status} in {time.monotonic() - t0:.0f} s",
                  flush=True)
            if proc.returncode:
                failed += 1
                print(out[-3000:], flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
