"""Kernel verification harness: does a registered op's Triton kernel compile, compute the right thing,
leave its inputs alone, run without quietly calling a reference, and beat the reference?

For each op in ``accel.registry`` and each shape of its ``VerifySpec``, on several fresh random seeds:

1. ``make_case(shape, seed, device)`` builds the inputs; the case is copied twice (storage-exact, so
   strides, offsets and aliasing survive) for the reference and for the kernel.
2. Outputs are poisoned: the in-place outputs named by ``Case.outputs`` are filled with NaN (integers:
   their maximum), and the kernel runs inside ``registry.poisoned_outputs()`` so the tensors it
   returns through ``registry.empty`` start as NaN too. An element the kernel never writes fails.
3. The kernel runs through the registry with Triton forced (a fall-back or ``Unsupported`` fails);
   ``registry.reference_call_count()`` before and after proves no reference of any op ran inside it,
   and ``verifier.fallback.record_call`` proves that at least one Triton kernel was launched, that no
   PyTorch operator beyond allocation, views and ``VerifySpec.allow`` ran, and that every output was
   last written by a kernel launch.
4. Every input tensor is compared bit for bit (NaN-aware) with the untouched original.
5. Outputs are compared with the reference's: ``VerifySpec.compare`` or, by default, ``calc_diff``
   per tensor, taken block by block so a wrong tile cannot hide in a large output (``blockwise_diff``),
   against ``VerifySpec.tolerance``, with NaN/Inf required at the same positions.
6. When every seed of a shape passed, kernel and reference are timed with ``accel.do_bench``
   (median, device events, L2 flushed on a GPU) for speedup, TFLOP/s and GB/s.

Output names: a returned tensor is ``out`` (``out[0]``, ``out[1]``... for tuples, ``out['key']`` for
dicts); an in-place output is named after the reference's parameter (``d`` for ``fp8_gemm_nt(a, b, d)``).
A custom ``VerifySpec.compare(got, want)`` receives ``{name: tensor}`` dicts with those names.

On the cpu the kernels run in the Triton interpreter: correctness holds, the timings mean nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import importlib.util
import inspect
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accel import registry, specs
from accel.backend import backend, default_device, device_name, synchronize
from accel.numerics import BLOCK_GRID, _as_float64, blockwise_diff, calc_diff, tensor_error  # noqa: F401 - scored with these
from accel.registry import Case, KernelOp
from accel.timing import do_bench
from verifier import fallback
from verifier.report import CPU_TIMING_NOTE, context, format_table

# Repeats for do_bench: on a GPU enough runs for a stable median; on the cpu (interpreter) as few as
# possible, since those timings only show that the timing path works.
GPU_BENCH = {"warmup": 10, "rep": 50}
CPU_BENCH = {"warmup": 1, "rep": 3}


@dataclass
class Result:
    """One op, one shape, one seed: whether the kernel passed, and why not.

    ``errors`` maps each output name to (error, tolerance). Timings (milliseconds) are filled on the
    first seed of a shape whose seeds all passed, and are None elsewhere.
    """

    op: str
    shape: dict[str, Any]
    seed: int | None
    passed: bool
    reason: str | None = None
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    max_error: float | None = None
    kernel_ms: float | None = None
    reference_ms: float | None = None
    speedup: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    peak_pct: float | None = None  # the nearer roofline: max(TFLOP/s / peak, GB/s / peak) x 100
    launches: int | None = None  # Triton kernel launches in one call of the op

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite floats become the strings 'nan' / 'inf' / '-inf'."""
        return _json_safe(dataclasses.asdict(self))


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def default_compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    tolerance: float) -> dict[str, tuple[float, float]]:
    """Per output: (tensor_error, tolerance); integer and bool outputs must match exactly."""
    out = {}
    for name, w in want.items():
        exact = not (w.is_floating_point() or w.is_complex())
        out[name] = (tensor_error(got[name], w), 0.0 if exact else tolerance)
    return out


# ----------------------------------------------------------------------------- cases


def _clone(obj: Any, memo: dict[int, torch.UntypedStorage]) -> Any:
    """Deep copy with tensors sharing storage as before (same strides, offsets and aliasing)."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key not in memo:
            memo[key] = obj.untyped_storage().clone()
        copy = torch.empty(0, dtype=obj.dtype, device=obj.device)
        copy.set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
        return copy.requires_grad_(obj.requires_grad) if obj.is_leaf else copy
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_clone(v, memo) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v, memo) for v in obj)
    if isinstance(obj, dict):
        return {k: _clone(v, memo) for k, v in obj.items()}
    return obj


def clone_case(case: Case) -> Case:
    """An independent copy of ``case`` whose tensors keep their layout and mutual aliasing."""
    memo: dict[int, torch.UntypedStorage] = {}
    return Case(args=_clone(case.args, memo), kwargs=_clone(case.kwargs, memo), outputs=tuple(case.outputs))


def named_tensors(prefix: str, obj: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` (nested tuples, lists, dicts) with a readable name."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, (list, tuple)):
        return [item for i, v in enumerate(obj) for item in named_tensors(f"{prefix}[{i}]", v)]
    if isinstance(obj, dict):
        return [item for k, v in obj.items() for item in named_tensors(f"{prefix}[{k!r}]", v)]
    return []


def _parameter_names(fn: Callable) -> list[str]:
    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _arg_name(names: list[str], i: int) -> str:
    return names[i] if i < len(names) else f"args[{i}]"


def _split(op: KernelOp, case: Case) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(inputs, in-place outputs) of a case as named tensors."""
    names = _parameter_names(op.reference)
    inputs, outputs = [], []
    for i, arg in enumerate(case.args):
        (outputs if i in case.outputs else inputs).extend(named_tensors(_arg_name(names, i), arg))
    for key, arg in case.kwargs.items():
        (outputs if key in case.outputs else inputs).extend(named_tensors(key, arg))
    return inputs, outputs


def _check_outputs_exist(case: Case) -> None:
    for o in case.outputs:
        if isinstance(o, int) and not 0 <= o < len(case.args):
            raise ValueError(f"Case.outputs names args[{o}] but the case has {len(case.args)} positional args")
        if isinstance(o, str) and o not in case.kwargs:
            raise ValueError(f"Case.outputs names kwarg {o!r} but the case has {sorted(case.kwargs)}")


def _poison(outputs: list[tuple[str, torch.Tensor]]) -> None:
    for _, t in outputs:
        with torch.no_grad():
            registry.fill(t, registry.poison_value(t.dtype))


def _results_of(op: KernelOp, case: Case, returned: Any) -> dict[str, torch.Tensor]:
    """Every tensor a call produced: its return value and its in-place outputs, by name."""
    got = dict(named_tensors("out", returned))
    for name, t in _split(op, case)[1]:
        got[f"{name} (in place)" if name in got else name] = t
    return got


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per element (any dtype, fp8 included; NaN compares equal to itself)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).view(-1, t.element_size())


def _changed_inputs(original: list[tuple[str, torch.Tensor]], after: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Inputs whose bits differ from the original, with how many elements changed."""
    changed = []
    for (name, before), (_, now) in zip(original, after):
        b0, b1 = _bits(before), _bits(now)
        if not torch.equal(b0, b1):
            n_changed = int((b0 != b1).any(dim=1).sum())
            changed.append(f"{name} ({n_changed} of {before.numel()} elements)")
    return changed


def _structure_mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    if set(got) != set(want):
        problems.append(f"kernel produced {sorted(got)}, reference {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if g.shape != w.shape:
            problems.append(f"{name}: shape {tuple(g.shape)}, reference {tuple(w.shape)}")
        elif g.dtype != w.dtype:
            problems.append(f"{name}: dtype {g.dtype}, reference {w.dtype}")
    return problems


def _describe_error(name: str, got: torch.Tensor, want: torch.Tensor, err: float, tol: float) -> str:
    if math.isfinite(err):
        return f"{name}: error {err:.3g} > tolerance {tol:.3g}"
    if (want.is_floating_point() or want.is_complex()) and got.shape == want.shape:
        g, w = _as_float64(got), _as_float64(want)
        unwritten = int((~torch.isfinite(g) & torch.isfinite(w)).sum())
        if unwritten:
            return f"{name}: {unwritten} of {w.numel()} elements NaN/Inf where the reference is finite (unwritten?)"
        return f"{name}: NaN/Inf where the kernel has finite values"
    return f"{name}: error {err} (tolerance {tol:.3g})"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ----------------------------------------------------------------------------- the check


def _counting(run: Callable, counter: list[int]) -> Callable:
    @functools.wraps(run)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("warmup", False):
            counter[0] += 1
        return run(self, *args, **kwargs)

    return counted


@contextlib.contextmanager
def count_triton_launches() -> Iterator[list[int] | None]:
    """Within the block, ``counter[0]`` counts Triton kernel launches (compiled or interpreted).

    Patches ``JITFunction.run`` and ``InterpretedFunction.run`` (every ``kernel[grid](...)`` and every
    autotuner trial goes through them) for the duration; yields None when Triton is not importable.
    This is how the harness proves that a "Triton implementation" launched a Triton kernel at all,
    rather than computing its result with PyTorch operations.
    """
    try:
        from triton.runtime import interpreter as _interpreter
        from triton.runtime import jit as _jit
    except ImportError:
        yield None
        return
    counter = [0]
    patched = []
    for cls in (_jit.JITFunction, _interpreter.InterpretedFunction):
        run = cls.__dict__.get("run")
        if run is not None:
            cls.run = _counting(run, counter)
            patched.append((cls, run))
    try:
        yield counter
    finally:
        for cls, run in patched:
            cls.run = run


def fresh_seeds(n: int) -> list[int]:
    """``n`` distinct random seeds from the OS (printed with each result, so a failure can be replayed)."""
    if n < 1:
        raise ValueError(f"seeds={n}: expected at least 1")
    rng = random.SystemRandom()
    seeds: set[int] = set()
    while len(seeds) < n:
        seeds.add(rng.randrange(2**31))
    return sorted(seeds)


@dataclass
class _Run:
    """One verified seed's copies, kept for timing."""

    kernel_case: Case
    reference_case: Case


def _check_seed(op: KernelOp, shape: dict, seed: int, device: torch.device) -> tuple[Result, _Run | None]:
    spec = op.verify
    result = Result(op=op.name, shape=dict(shape), seed=seed, passed=False)
    torch.manual_seed(seed)
    try:
        case = spec.make_case(dict(shape), seed, device)
        if not isinstance(case, Case):
            raise TypeError(f"make_case returned {type(case).__name__}, expected accel.registry.Case")
        _check_outputs_exist(case)
    except Exception as exc:
        result.reason = f"make_case failed: {_short(exc)}"
        return result, None

    original_inputs = _split(op, case)[0]
    ref_case, ker_case = clone_case(case), clone_case(case)
    _poison(_split(op, ref_case)[1])
    _poison(_split(op, ker_case)[1])

    try:
        want = _results_of(op, ref_case, op.reference(*ref_case.args, **ref_case.kwargs))
    except Exception as exc:
        result.reason = f"reference raised {_short(exc)}"
        return result, None

    problems = []
    calls_before = registry.reference_call_counts()
    kernel_inputs, kernel_outputs = _split(op, ker_case)
    try:
        with registry.force("triton"), registry.poisoned_outputs(), \
                fallback.record_call([t for _, t in kernel_inputs], allow=spec.allow) as record:
            returned = op(*ker_case.args, **ker_case.kwargs)
            synchronize()
    except Exception as exc:
        result.reason = f"kernel raised {_short(exc)}"
        return result, None
    calls_after = registry.reference_call_counts()
    called = {name: calls_after[name] - calls_before.get(name, 0) for name in calls_after
              if calls_after[name] != calls_before.get(name, 0)}
    if called:
        problems.append("kernel called a reference: " + ", ".join(f"{n} x{c}" for n, c in sorted(called.items())))
    counted = importlib.util.find_spec("triton") is not None  # the recorder counts launches when Triton imports
    if counted:
        result.launches = record.launches
        if not record.launches:
            problems.append("the Triton implementation launched no Triton kernel")
    if op.last_impl != "triton":
        problems.append(f"the registry ran {op.last_impl!r}, not the Triton kernel")
    problems += record.problems()
    if not counted or record.launches:  # "no launch" is said above
        problems += [p for p in fallback.output_problems(
            record, named_tensors("out", returned) + kernel_outputs, kernel_inputs)
            if p != "the candidate launched no Triton kernel"]

    changed = _changed_inputs(original_inputs, _split(op, ker_case)[0])
    if changed:
        problems.append("kernel modified its inputs: " + ", ".join(changed))

    got = _results_of(op, ker_case, returned)
    mismatch = _structure_mismatch(got, want)
    problems += mismatch
    if not mismatch:
        try:
            errors = (spec.compare(got, want) if spec.compare is not None
                      else default_compare(got, want, spec.tolerance))
        except Exception as exc:
            errors = {}
            problems.append(f"compare raised {_short(exc)}")
        result.errors = {k: (float(e), float(t)) for k, (e, t) in errors.items()}
        if result.errors:
            result.max_error = max(e for e, _ in result.errors.values())
        for name, (err, tol) in result.errors.items():
            if not err <= tol:  # NaN fails too
                if name in got and name in want:
                    problems.append(_describe_error(name, got[name], want[name], err, tol))
                else:
                    problems.append(f"{name}: error {err:.3g} > tolerance {tol:.3g}")

    result.passed = not problems
    result.reason = "; ".join(problems) or None
    return result, _Run(ker_case, ref_case) if result.passed else None


def _time(op: KernelOp, shape: dict, run: _Run, result: Result, bench_kwargs: dict[str, int]) -> None:
    spec, k, r = op.verify, run.kernel_case, run.reference_case
    result.kernel_ms = do_bench(lambda: op.triton(*k.args, **k.kwargs), **bench_kwargs)
    result.reference_ms = do_bench(lambda: op.reference(*r.args, **r.kwargs), **bench_kwargs)
    if result.kernel_ms > 0:
        result.speedup = result.reference_ms / result.kernel_ms
        seconds = result.kernel_ms * 1e-3
        if spec.flops is not None:
            result.tflops = spec.flops(dict(shape)) / seconds / 1e12
        if spec.bytes_moved is not None:
            result.gbps = spec.bytes_moved(dict(shape)) / seconds / 1e9
        result.peak_pct = peak_percent(result.tflops, result.gbps, fp8=spec.fp8)


def peak_percent(tflops: float | None, gbps: float | None, fp8: bool = False,
                 device: str | None = None) -> float | None:
    """Percent of the device's nearer roofline (compute or memory), None for an unknown device (cpu)."""
    peak = specs.lookup(device or device_name())
    if peak is None:
        return None
    fractions = []
    flops_peak = peak.fp8_tflops if fp8 and peak.fp8_tflops else peak.bf16_tflops
    if tflops is not None:
        fractions.append(tflops / flops_peak)
    if gbps is not None:
        fractions.append(gbps / peak.memory_gbps)
    return 100 * max(fractions) if fractions else None


def verify_op(name: str, shapes: Sequence[dict] | None = None, seeds: int | Sequence[int] = 5, *,
              bench: bool = True, bench_shapes: bool = False, device: torch.device | None = None,
              on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Verify one registered op; one Result per (shape, seed).

    shapes: defaults to the VerifySpec's ``shapes`` (plus ``bench_shapes`` when ``bench_shapes``).
    seeds: how many fresh random seeds, or the exact seeds to replay a failure.
    bench: time kernel and reference for each shape whose seeds all passed.
    """
    op = registry.get(name)
    if op.verify is None:
        return [Result(op=name, shape={}, seed=None, passed=False,
                       reason="no VerifySpec registered (pass verify=VerifySpec(...) to registry.register)")]
    if op.triton is None:
        return [Result(op=name, shape={}, seed=None, passed=False, reason="no Triton implementation registered")]
    if shapes is None:
        shapes = list(op.verify.shapes) + (list(op.verify.bench_shapes) if bench_shapes else [])
    elif isinstance(shapes, dict) or not all(isinstance(s, dict) for s in shapes):
        raise ValueError(f"shapes: expected a list of dicts (one per shape), got {shapes!r}")
    if not shapes:
        return [Result(op=name, shape={}, seed=None, passed=False, reason="VerifySpec has no shapes")]
    seed_list = fresh_seeds(seeds) if isinstance(seeds, int) else list(seeds)
    if not seed_list or not all(isinstance(s, int) for s in seed_list):
        raise ValueError(f"seeds: expected a positive count or a non-empty list of int seeds, got {seeds!r}")
    device = device or default_device()
    bench_kwargs = CPU_BENCH if backend() == "cpu" else GPU_BENCH

    results: list[Result] = []
    for shape in shapes:
        shape_results, first_run = [], None
        for seed in seed_list:
            result, run = _check_seed(op, shape, seed, device)
            first_run = first_run or run
            shape_results.append(result)
        if bench and first_run is not None and all(r.passed for r in shape_results):
            try:
                _time(op, shape, first_run, shape_results[0], bench_kwargs)
            except Exception as exc:
                shape_results[0].passed = False
                shape_results[0].reason = f"timing failed: {_short(exc)}"
        for result in shape_results:
            if on_result is not None:
                on_result(result)
        results += shape_results
    return results


def select_ops(patterns: str | Iterable[str] | None = None) -> list[str]:
    """Registered op names matching any of the glob ``patterns`` (one glob or several; all ops when None)."""
    names = registry.ops()
    if patterns is None:
        return names
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


# ----------------------------------------------------------------------------- reporting


def format_shape(shape: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items()) or "-"


def summarize(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One table row per (op, shape): seeds passed, worst error, timings, PASS/FAIL."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.op, format_shape(r.shape)), []).append(r)
    rows = []
    for (op, shape), rs in groups.items():
        errors = [r.max_error for r in rs if r.max_error is not None]
        tolerances = [t for r in rs for _, t in r.errors.values()]
        timed = next((r for r in rs if r.kernel_ms is not None), None)
        rows.append({
            "op": op, "shape": shape,
            "seeds": f"{sum(r.passed for r in rs)}/{len(rs)}",
            "launches": max((r.launches for r in rs if r.launches is not None), default=None),
            "max_err": max(errors) if errors else None,
            "tol": max(tolerances) if tolerances else None,
            "kernel_ms": timed and timed.kernel_ms, "ref_ms": timed and timed.reference_ms,
            "speedup": timed and timed.speedup, "TFLOP/s": timed and timed.tflops, "GB/s": timed and timed.gbps,
            "%peak": timed and timed.peak_pct,
            "result": "PASS" if all(r.passed for r in rs) else "FAIL",
        })
    return rows


def failures(results: Sequence[Result]) -> list[str]:
    """One line per failed (op, shape): the seeds that replay it and the first failing seed's reason
    (every seed's reason is in the JSON)."""
    failed: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if not r.passed:
            failed.setdefault((r.op, format_shape(r.shape)), []).append(r)
    return [f"FAIL {op} [{shape}] seeds={','.join(str(r.seed) for r in rs)}: {rs[0].reason}"
            for (op, shape), rs in failed.items()]


def notes() -> list[str]:
    """What a reader must know about where these numbers come from."""
    if backend() == "cpu":
        return [f"{CPU_TIMING_NOTE}; correctness was checked in the Triton interpreter"]
    return ["timings: median of do_bench runs with device events, L2 flushed before each run"]


def format_report(results: Sequence[Result]) -> str:
    """The terminal report: context line, table, failures, notes."""
    ctx = context()
    lines = ["== kernel verification ==", ", ".join(f"{k}={v}" for k, v in ctx.items()),
             format_table(summarize(results))]
    lines += failures(results)
    lines += [f"note: {n}" for n in notes()]
    return "\n".join(lines)


def write_json(path: str | Path, results: Sequence[Result], extra: dict[str, Any] | None = None) -> None:
    """Context, per-seed results, the summary rows and the notes as one JSON document."""
    doc = {"title": "kernel verification", "context": context(), "passed": all(r.passed for r in results),
           "rows": _json_safe(summarize(results)), "results": [r.to_dict() for r in results], "notes": notes()}
    doc.update(extra or {})
    Path(path).write_text(json.dumps(doc, indent=2))
