"""Verify kernels: a candidate file against its reference, a suite of them, or every registered op.

    python -m recipes.verify_kernels --candidate NEW.py --reference REF.py [--json v.json]
    python -m recipes.verify_kernels --candidate NEW.py --reference REF.py --shapes batch_size=8,dim=256
    python -m recipes.verify_kernels --suite tests/verify_suite --json suite.json   # one subprocess each
    python -m recipes.verify_kernels                      # every registered op, its small shapes, 5 seeds
    python -m recipes.verify_kernels --ops 'deep_gemm.*' --seeds 8 --json verify.json
    python -m recipes.verify_kernels --bench-shapes       # plus the realistic GPU shapes (GPU only)
    python -m recipes.verify_kernels --ops toy.axpby --seed 123 --seed 456   # replay failing seeds

(installed as ``dsv3-verify-kernels``). Each candidate file runs in a child process of its own (``verifier.sandbox``),
also under --candidate: a candidate that exits (``sys.exit``, ``os._exit``, any status), crashes (a segfault,
an uncaught exception, a kill) or runs past --timeout (default 600 s; the child's whole process group is then
killed) fails a gate with the reason in the table and the JSON; the verdict is what the harness in the child
reported over a private channel, never the child's exit status or output. On a cpu the kernels run in the
Triton interpreter (TRITON_INTERPRET=1 is set here when unset): correctness is checked, timings mean nothing.
Candidate files are scored by MusaCoder's four gates (compiles, correct, no_fallback, faster), each
reported on its own; formats and gates are described in ``verifier.candidate`` and docs/foundation.md.
Exit status: 0 every gate measurable here passed, 1 a gate failed (or a kernel package failed to
import), 2 bad input (unusable files or arguments; nothing to verify). Registered ops are checked by
``verifier.verify``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from accel.cli import ArgumentParser, check_output_file, nonnegative_float

EXIT_OK, EXIT_FAILED, EXIT_NOTHING = 0, 1, 2
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT = 600  # seconds per candidate, --candidate and --suite alike
STAGE_GATE = {"reference": "compiles", "compiles": "compiles", "correct": "correct", "faster": "faster"}


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dsv3-verify-kernels", description=__doc__.split("\n\n")[0])
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
    g = p.add_argument_group("candidate files (the four gates)")
    g.add_argument("--candidate", metavar="NEW.py", help="candidate file: ModelNew (KernelBench) or candidate(); "
                   "verified in a child process of its own (see --timeout)")
    g.add_argument("--reference", metavar="REF.py",
                   help="reference file: Model/get_inputs/get_init_inputs (KernelBench) or reference/make_inputs")
    g.add_argument("--suite", metavar="DIR", help="verify every DIR/<problem>/candidate*.py against its "
                   "reference.py, each in its own subprocess")
    g.add_argument("--shapes", metavar="NAME=V,...", help="override the reference's module-level sizes")
    g.add_argument("--tolerance", type=nonnegative_float, metavar="T",
                   help="atol = rtol for every float output (default by dtype: fp32 1e-4, bf16/fp16 1e-2)")
    g.add_argument("--min-speedup", type=nonnegative_float, default=1.0, metavar="X",
                   help="the faster gate passes at speedup >= X over the reference (default 1.0)")
    g.add_argument("--allow", action="append", default=[], metavar="OP=REASON",
                   help="let the candidate run PyTorch operator OP (e.g. aten.mm=...), repeatable")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help="seconds per candidate (--candidate or each of --suite) before its process group is "
                        f"killed and its verdict is a failed gate (default {DEFAULT_TIMEOUT})")
    g.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the sandboxed child's mode
    return p


def _parse_shapes(text: str | None) -> dict[str, float]:
    shapes = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        try:
            shapes[name.strip()] = float(value) if sep else None
        except ValueError:
            shapes[name.strip()] = None
        if shapes[name.strip()] is None:
            raise ValueError(f"--shapes {item!r}: expected NAME=NUMBER")
        if not 0 < shapes[name.strip()] < math.inf:  # a size of 0 is an empty problem: it would verify nothing
            raise ValueError(f"--shapes {item!r}: expected a size, a finite number > 0")
    return shapes


def _parse_allow(items: Sequence[str]) -> dict[str, str]:
    allow = {}
    for item in items:
        name, sep, reason = item.partition("=")
        if not sep or not reason.strip():
            raise ValueError(f"--allow {item!r}: expected OP=REASON (say why the operator is legitimate)")
        allow[name.strip()] = reason.strip()
    return allow


def _interpreter_on_cpu() -> None:
    import accel

    if accel.backend() == "cpu" and not accel.triton_interpreted():
        # Must precede any @triton.jit: the interpreter is picked when a kernel is decorated.
        os.environ["TRITON_INTERPRET"] = "1"
        accel.reset()


def verify_files(args: argparse.Namespace) -> int:
    """--candidate/--reference: the four gates on one candidate, in a child process (``run_one``)."""
    from verifier import candidate

    doc = run_one(args, Path(args.candidate), Path(args.reference))
    verdict = candidate.verdict_from_dict(doc)
    print(candidate.format_verdict(verdict), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}", flush=True)
    if doc.get("output_tail"):  # after the verdict, quoted line by line: never taken for the verifier's own
        print(format_output_tail(doc["output_tail"]), file=sys.stderr)
    return verdict.exit_code


def format_output_tail(lines: list[str]) -> str:
    """The candidate process's last output lines, under a heading and each behind ``| ``."""
    return (f"candidate process output (its last {len(lines)} lines, not the verifier's):\n"
            + "\n".join(f"  | {line}" for line in lines))


def run_worker(args: argparse.Namespace) -> NoReturn:
    """The sandboxed child: verify in this process, report each stage and the verdict to the parent."""
    from verifier import candidate, sandbox

    if os.isatty(0):
        raise SystemExit("error: --worker is the sandboxed child's mode, started by --candidate/--suite only")
    reporter = sandbox.Reporter.from_stdin()  # before the candidate is imported
    verdict = candidate.verify_candidate(
        args.candidate, args.reference, seeds=args.seed or args.seeds, tolerance=args.tolerance,
        min_speedup=args.min_speedup, shapes=_parse_shapes(args.shapes), allow=_parse_allow(args.allow),
        bench=not args.no_bench, progress=lambda stage, v: reporter.send(stage=stage, verdict=v.to_dict()))
    reporter.finish(verdict.exit_code, stage="done", verdict=verdict.to_dict())


def suite_problems(directory: str | Path) -> list[tuple[Path, Path]]:
    """(candidate, reference) pairs: every ``<problem>/candidate*.py`` with its ``<problem>/reference.py``."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"--suite {directory}: not a directory")
    pairs = [(c, d / "reference.py") for d in sorted(p for p in root.iterdir() if p.is_dir())
             if (d / "reference.py").is_file() for c in sorted(d.glob("candidate*.py"))]
    if not pairs:
        raise ValueError(f"--suite {directory}: no <problem>/reference.py with candidate*.py beside it")
    return pairs


def _worker_argv(args: argparse.Namespace, cand: Path, ref: Path) -> list[str]:
    argv = [sys.executable, "-m", "recipes.verify_kernels", "--worker", "--candidate", str(cand),
            "--reference", str(ref), "--min-speedup", str(args.min_speedup)]
    for s in args.seed or []:
        argv += ["--seed", str(s)]
    if not args.seed:
        argv += ["--seeds", str(args.seeds)]
    if args.tolerance is not None:
        argv += ["--tolerance", str(args.tolerance)]
    if args.shapes:
        argv += ["--shapes", args.shapes]
    argv += [x for a in args.allow for x in ("--allow", a)] + (["--no-bench"] if args.no_bench else [])
    return argv


def run_one(args: argparse.Namespace, cand: Path, ref: Path) -> dict:
    """One candidate in its own process (``verifier.sandbox``): its verdict as a dict (``Verdict.to_dict()`` plus
    ``seconds``, and ``output_tail`` when the child ended without a verdict). An exit, crash, kill or hang costs
    only this verdict, and is a failed gate: the one the harness had reached (``STAGE_GATE``)."""
    from verifier import candidate, sandbox

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    outcome = sandbox.run(_worker_argv(args, cand, ref), timeout=args.timeout, env=env)
    final = outcome.final
    if final and not outcome.forged and outcome.returncode == final["status"]:
        doc = final["verdict"]
    else:
        last = next((m for m in reversed(outcome.messages) if isinstance(m.get("verdict"), dict)), None)
        verdict = (candidate.verdict_from_dict(last["verdict"]) if last
                   else candidate.Verdict(candidate=str(cand), reference=str(ref), min_speedup=args.min_speedup))
        stage = last["stage"] if last else None
        if final and outcome.returncode != final["status"]:
            verdict.fail("no_fallback", f"candidate process {outcome.how_it_ended()} after its harness reported "
                         f"status {final['status']}: something besides the harness ended it")
        elif not final:
            where = ("" if stage is None else " (while the reference was checked)" if stage == "reference"
                     else f" (in the {STAGE_GATE[stage]} gate)")
            if outcome.timed_out:
                why = f"timed out after {args.timeout:g} s{where}; its process group was killed"
            else:
                why = f"candidate {outcome.how_it_ended()} before reporting a verdict{where}"
                why += f"; last output: {outcome.log[-1][:300]}" if outcome.log else ""
            verdict.fail(STAGE_GATE.get(stage, "compiles"), why)
        if outcome.forged:
            verdict.fail("no_fallback", f"{outcome.forged} line(s) in the result channel were not written by the "
                         "harness (a forged result?)")
        doc = verdict.to_dict()
        if not final:
            doc["output_tail"] = outcome.log
    doc["seconds"] = outcome.seconds
    return doc


def verify_suite(args: argparse.Namespace) -> int:
    from verifier import candidate

    try:
        pairs = suite_problems(args.suite)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NOTHING
    docs = []
    for i, (cand, ref) in enumerate(pairs, 1):
        print(f"[{i}/{len(pairs)}] {cand.parent.name}/{cand.name} ...", end=" ", flush=True)
        doc = run_one(args, cand, ref)
        docs.append(doc)
        failed = [g for g, v in doc["gates"].items() if v["status"] == "fail"]
        print(f"{doc['verdict']} ({doc['seconds']:.1f} s)" + (f" failed: {', '.join(failed)}" if failed else "")
              + (f" bad input: {doc['bad_input']}" if doc.get("bad_input") else ""), flush=True)
    verdicts = [candidate.verdict_from_dict(d) for d in docs]
    print(candidate.format_suite(verdicts))
    for d in docs:
        for g, v in d["gates"].items():
            if v["status"] == "fail":
                print(f"FAIL {Path(d['candidate']).parent.name}/{Path(d['candidate']).name} {g}: {v['message']}")
    if args.json:
        from verifier.report import context

        Path(args.json).write_text(json.dumps({"title": "kernel verification suite", "context": context(),
                                               "summary": candidate.suite_summary(verdicts), "verdicts": docs},
                                              indent=2))
        print(f"wrote {args.json}")
    return EXIT_OK if all(v.passed for v in verdicts) else EXIT_FAILED


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
    if bool(args.candidate) != bool(args.reference):
        _parser().error("--candidate and --reference go together")
    if args.suite and args.candidate:
        _parser().error("--suite or --candidate/--reference, not both")
    try:
        _parse_shapes(args.shapes), _parse_allow(args.allow)
        if args.json:
            check_output_file(args.json, "--json")
    except ValueError as exc:
        _parser().error(str(exc))
    if not 0 < args.timeout < float("inf"):
        _parser().error(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    if args.worker and not args.candidate:
        _parser().error("--worker is the sandboxed child's mode, started by --candidate/--suite only")

    import accel  # imported after parsing so that --help is instant

    _interpreter_on_cpu()
    if args.worker:
        run_worker(args)
    if args.candidate:
        return verify_files(args)
    if args.suite:
        return verify_suite(args)
    from accel import registry
    from verifier import verify

    problems = []
    # Only the packages the globs can select: `--ops toy.*` neither waits for nor depends on deep_gemm.
    wanted = [pkg for pkg in registry.KERNEL_PACKAGES if args.list or _concerns(pkg, args.ops)]
    for pkg, why in registry.import_kernel_packages(wanted).items():
        if why and why != "not installed":
            problems.append(f"kernel package {pkg} failed to import: {why}")
    for module in args.modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                problems.append(f"--import {module} failed: {type(exc).__name__}: {exc}")
                continue
            print(f"error: --import {module}: no such module (check the name and PYTHONPATH)", file=sys.stderr)
            return EXIT_NOTHING
        except Exception as exc:
            problems.append(f"--import {module} failed: {type(exc).__name__}: {exc}")
    for line in problems:
        print(f"ERROR {line}", file=sys.stderr)

    registered = registry.ops()
    if args.list:
        rows = [{"op": name, "impl": info["impl"], "verify_shapes": len(registry.get(name).verify.shapes)
                 if registry.get(name).verify else 0, "reason": info["reason"]}
                for name, info in registry.report().items()]
        print(verify.format_table(rows) if rows else "no kernel ops are registered")
        return EXIT_FAILED if problems else EXIT_OK
    if not registered:
        print("error: no kernel ops are registered: nothing to verify (the kernel packages deep_gemm and flash_mla "
              "register theirs when imported; use --import MODULE for others)", file=sys.stderr)
        return EXIT_FAILED if problems else EXIT_NOTHING
    names = verify.select_ops(args.ops)
    if not names:
        print(f"error: --ops: no registered op matches {' '.join(args.ops)}; registered: {', '.join(registered)}",
              file=sys.stderr)
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
