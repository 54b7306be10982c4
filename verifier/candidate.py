"""Verify a candidate kernel file against a reference file: MusaCoder's four admission gates.

Two formats (``load_problem`` tells them apart by what the reference defines):

- KernelBench: the reference defines ``class Model(nn.Module)``, ``get_inputs()`` and
  ``get_init_inputs()``; the candidate defines ``class ModelNew`` with the same constructor. Both
  are built from the same init inputs under the same seed and the reference's weights are copied
  into the candidate (parameters and buffers of the same name and shape); inputs come from
  ``get_inputs()`` under a fresh seed.
- Plain functions: the reference defines ``reference(*inputs)`` and ``make_inputs(seed, device)``;
  the candidate defines ``candidate(*inputs)``.

Optional names in the reference file: ``ALLOW = {"aten.op": "reason"}`` (operators the candidate
may run besides allocation and views), ``TOLERANCE`` (a float, or ``{dtype: float}``), and a
``vendor(*inputs)`` function (KernelBench: ``class ModelVendor``), the vendor-library path timed
beside the reference. A candidate file may declare ``ALLOW`` too, but only layout copies and casts.

The gates, each reported on its own (``Gate.status``: pass, fail, not measurable, not run):

1. compiles: the candidate imports, is built, and its first call succeeds on this backend (CUDA,
   MUSA, or the Triton CPU interpreter); the compiler's error is shown when not.
2. correct: on at least 5 fresh seeds, inputs unchanged, outputs of the reference's shapes and
   dtypes, every element within ``atol = rtol = tolerance`` (by output dtype: fp32 1e-4,
   bf16/fp16 1e-2, fp8 1e-1, integers exact; KernelBench's current values) and block-wise
   ``calc_diff`` (``accel.numerics.tensor_error``) <= the same tolerance. ``empty`` allocations are
   NaN-poisoned, so an unwritten element fails. The first seed runs twice on the same inputs: a
   cached result keyed by pointer or shape is caught by the repeat or the next seed.
3. no_fallback: ``verifier.fallback.record_call`` around every call: no PyTorch operator beyond
   allocation, views and the allow-list; outputs written by the candidate's own Triton launches
   (none launched, an output produced by a PyTorch op, a cached tensor or an input all fail); no
   launch from another thread or onto a side stream; no registered reference called; and nothing
   in the harness, torch's comparison functions, the timers or Triton's launcher replaced.
4. faster: ``accel.do_bench`` (median, device events, L2 flushed) of candidate vs reference (and
   vendor), passing at ``speedup >= min_speedup``; "not measurable" on the cpu.

Problems with the files themselves (``BadInput``: no ``ModelNew``/``candidate``, mismatched
constructors, a reference that is not deterministic) give verdict ``bad input`` (exit code 2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from accel import numerics, registry
from accel.backend import backend, default_device, synchronize
from accel.timing import do_bench
from verifier import fallback, verify
from verifier.report import format_table

GATES = ("compiles", "correct", "no_fallback", "faster")
STAGES = ("reference", "compiles", "correct", "faster")  # what verify_candidate's progress callback names
PASS, FAIL, NOT_MEASURABLE, NOT_RUN = "pass", "fail", "not measurable", "not run"
EXIT_PASSED, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2,
                     torch.float8_e4m3fn: 1e-1, torch.float8_e5m2: 1e-1}
MIN_SEEDS = 5
INIT_SEED = 42
FAST_P = (0.0, 1.0, 1.5, 2.0)


class BadInput(Exception):
    """The reference or candidate file cannot be verified as given (the message says what is wrong)."""


@dataclass
class Gate:
    status: str = NOT_RUN
    message: str | None = None


@dataclass
class Verdict:
    """Per-gate results for one candidate; ``exit_code`` 0 passed, 1 a gate failed, 2 bad input."""

    candidate: str
    reference: str
    format: str | None = None
    gates: dict[str, Gate] = field(default_factory=lambda: {g: Gate() for g in GATES})
    bad_input: str | None = None
    seeds: list[int] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)
    max_errors: dict[str, float] = field(default_factory=dict)
    launches: int | None = None
    operators: dict[str, int] = field(default_factory=dict)
    candidate_ms: float | None = None
    reference_ms: float | None = None
    vendor_ms: float | None = None
    speedup: float | None = None
    vendor_speedup: float | None = None
    min_speedup: float = 1.0
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.bad_input:
            return EXIT_BAD_INPUT
        ok = all(g.status in (PASS, NOT_MEASURABLE) for g in self.gates.values())
        return EXIT_PASSED if ok else EXIT_FAILED

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_PASSED

    @property
    def correct(self) -> bool:
        return all(self.gates[g].status == PASS for g in ("compiles", "correct", "no_fallback"))

    def fail(self, gate: str, message: str) -> None:
        g = self.gates[gate]
        g.message = f"{g.message}; {message}" if g.status == FAIL and g.message else message
        g.status = FAIL

    def to_dict(self) -> dict[str, Any]:
        return verify._json_safe({
            "candidate": self.candidate, "reference": self.reference, "format": self.format,
            "verdict": "bad input" if self.bad_input else ("PASS" if self.passed else "FAIL"),
            "exit_code": self.exit_code, "bad_input": self.bad_input,
            "gates": {name: {"status": g.status, "message": g.message} for name, g in self.gates.items()},
            "seeds": self.seeds, "tolerances": self.tolerances, "max_errors": self.max_errors,
            "launches": self.launches, "operators": self.operators, "candidate_ms": self.candidate_ms,
            "reference_ms": self.reference_ms, "vendor_ms": self.vendor_ms, "speedup": self.speedup,
            "vendor_speedup": self.vendor_speedup, "min_speedup": self.min_speedup, "notes": self.notes,
        })


def verdict_from_dict(doc: Mapping[str, Any]) -> Verdict:
    """A Verdict back from ``to_dict()`` output (the suite reads its subprocesses' JSON)."""
    def number(x: Any) -> float | None:
        return float(x) if isinstance(x, (int, float, str)) and x is not None else None

    v = Verdict(candidate=doc["candidate"], reference=doc["reference"], format=doc.get("format"),
                bad_input=doc.get("bad_input"), seeds=list(doc.get("seeds", [])),
                min_speedup=float(doc.get("min_speedup", 1.0)), notes=list(doc.get("notes", [])))
    v.gates = {g: Gate(d["status"], d.get("message")) for g, d in doc["gates"].items()}
    for key in ("candidate_ms", "reference_ms", "vendor_ms", "speedup", "vendor_speedup"):
        setattr(v, key, number(doc.get(key)))
    v.tolerances = {k: float(x) for k, x in (doc.get("tolerances") or {}).items()}
    v.max_errors = {k: float(x) for k, x in (doc.get("max_errors") or {}).items()}
    v.launches = doc.get("launches")
    v.operators = dict(doc.get("operators") or {})
    return v


# ----------------------------------------------------------------------------- integrity


def _watched() -> list[tuple[Any, str]]:
    """(owner, attribute) pairs a candidate must not replace: comparisons, timers, launcher, the harness."""
    import threading

    from torch.utils import _python_dispatch

    backend_module = importlib.import_module("accel.backend")  # the package attribute is the function
    timing_module = importlib.import_module("accel.timing")

    pairs: list[tuple[Any, str]] = [
        (torch, "allclose"), (torch, "isclose"), (torch, "equal"), (torch, "manual_seed"),
        (torch.testing, "assert_close"), (torch.Tensor, "__eq__"), (torch.Tensor, "sub"), (torch.Tensor, "abs"),
        (torch.cuda, "Event"), (torch.cuda, "synchronize"), (torch.cuda.Event, "elapsed_time"),
        (torch.cuda.Event, "record"), (time, "perf_counter"), (time, "time"), (time, "monotonic"),
        (time, "perf_counter_ns"), (backend_module, "Event"), (backend_module, "synchronize"),
        (backend_module.Event, "record"), (backend_module.Event, "elapsed_time"), (threading.Thread, "start"),
        (_python_dispatch.TorchDispatchMode, "__enter__"), (_python_dispatch.TorchDispatchMode, "__exit__"),
    ]
    for module in (timing_module, fallback, verify, registry, sys.modules[__name__]):
        pairs += [(module, name) for name, value in vars(module).items()
                  if callable(value) and not name.startswith("__")]
    try:
        from triton.runtime import interpreter, jit

        pairs += [(jit.JITFunction, "run"), (interpreter.InterpretedFunction, "run")]
    except ImportError:
        pass
    return pairs


class Integrity:
    """A snapshot of the watched attributes; ``check()`` names (and undoes) any replacement."""

    def __init__(self) -> None:
        with fallback.record_call():  # the first op under a dispatch mode imports torch._dynamo, which wraps
            torch.empty(0)           # torch.manual_seed: let that happen before the snapshot
        self._saved = [(owner, name, owner.__dict__.get(name, getattr(owner, name, None)))
                       for owner, name in _watched()]

    def check(self) -> list[str]:
        replaced = []
        for owner, name, value in self._saved:
            if owner.__dict__.get(name, getattr(owner, name, None)) is not value:
                setattr(owner, name, value)
                replaced.append(f"{getattr(owner, '__name__', owner)}.{name}")
        return replaced


# ----------------------------------------------------------------------------- loading


_loaded = itertools.count()


def load_file(path: str | Path, role: str) -> ModuleType:
    """Import a Python file under a fresh module name (its folder on sys.path while it imports)."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{role} file {path} does not exist")
    name = f"_dsv3_{role}_{next(_loaded)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent.resolve()))
    return module


def _signature(cls: type) -> list[str]:
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [("*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else "") + p.name
            for p in params]


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


@dataclass
class Problem:
    """A reference with its inputs, in either format, and how to build a candidate for it."""

    format: str
    module: ModuleType
    make_inputs: Callable[[int, torch.device], tuple]
    build_reference: Callable[[torch.device], Callable]
    build_vendor: Callable[[torch.device], Callable] | None
    allow: dict[str, str]
    tolerance: float | Mapping[torch.dtype, float] | None

    def build_candidate(self, module: ModuleType, device: torch.device) -> tuple[Callable, list]:
        """(callable, named parameters/buffers) of the candidate; BadInput when it lacks the entry point."""
        if self.format == "kernelbench":
            cls = getattr(module, "ModelNew", None)
            if not isinstance(cls, type):
                raise BadInput("candidate defines no class ModelNew (KernelBench format: the reference defines "
                               "Model, so the candidate must define ModelNew with the same constructor)")
            ref_sig, new_sig = _signature(self.module.Model), _signature(cls)
            if ref_sig != new_sig and "*args" not in new_sig:
                raise BadInput(f"mismatched constructor: Model({', '.join(ref_sig)}) but "
                               f"ModelNew({', '.join(new_sig)})")
            reference = self.build_reference(device)
            model = _construct(cls, self.module, "ModelNew").to(device)
            copied = _copy_weights(reference, model)
            state = [(f"ModelNew.{n}", t) for n, t in itertools.chain(model.named_parameters(), model.named_buffers())]
            model.copied_weights = copied
            return model, state
        fn = getattr(module, "candidate", None)
        if not callable(fn):
            raise BadInput("candidate defines no function candidate(*inputs) (plain-function format: the reference "
                           "defines reference/make_inputs)")
        return fn, []


def _construct(cls: type, module: ModuleType, what: str) -> torch.nn.Module:
    torch.manual_seed(INIT_SEED)
    init = module.get_init_inputs()
    torch.manual_seed(INIT_SEED)
    try:
        return cls(*init)
    except TypeError as exc:
        raise BadInput(f"{what}(*get_init_inputs()) failed: {exc}") from None


def _copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy parameters and buffers of the same name and shape from ``src``; returns how many."""
    theirs = dict(itertools.chain(src.named_parameters(), src.named_buffers()))
    copied = 0
    with torch.no_grad():
        for name, t in itertools.chain(dst.named_parameters(), dst.named_buffers()):
            if name in theirs and theirs[name].shape == t.shape:
                t.copy_(theirs[name])
                copied += 1
    return copied


def apply_shapes(module: ModuleType, shapes: Mapping[str, Any] | None) -> None:
    """Override the reference's module-level sizes (``--shapes batch_size=8,dim=256``)."""
    for name, value in (shapes or {}).items():
        if not isinstance(getattr(module, name, None), (int, float)):
            sizes = sorted(k for k, v in vars(module).items() if isinstance(v, int) and not k.startswith("_"))
            raise BadInput(f"--shapes {name}={value}: the reference has no module-level number {name!r}; "
                           f"it has: {', '.join(sizes) or 'none'}")
        kind = type(getattr(module, name))
        if kind is int and not (float(value).is_integer() and value >= 1):
            raise BadInput(f"--shapes {name}={value:g}: {name} is an integer size of the reference, expected an "
                           "integer >= 1 (a size of 0 makes an empty problem, which verifies nothing)")
        if not math.isfinite(value):
            raise BadInput(f"--shapes {name}={value}: expected a finite number")
        setattr(module, name, kind(value))


def load_problem(reference: str | Path | ModuleType, shapes: Mapping[str, Any] | None = None) -> Problem:
    """Load a reference file (either format); BadInput naming what is missing."""
    try:
        module = reference if isinstance(reference, ModuleType) else load_file(reference, "reference")
    except BadInput:
        raise
    except Exception as exc:
        raise BadInput(f"reference {reference} failed to import: {verify._short(exc)}") from None
    apply_shapes(module, shapes)
    allow = fallback.normalize_allow(getattr(module, "ALLOW", None))
    tolerance = getattr(module, "TOLERANCE", None)
    if all(hasattr(module, n) for n in ("Model", "get_inputs", "get_init_inputs")):
        def make_inputs(seed: int, device: torch.device) -> tuple:
            torch.manual_seed(seed)
            return tuple(_to_device(module.get_inputs(), device))

        def build(cls_name: str) -> Callable[[torch.device], Callable]:
            return lambda device: _construct(getattr(module, cls_name), module, cls_name).to(device)

        vendor = build("ModelVendor") if hasattr(module, "ModelVendor") else None
        return Problem("kernelbench", module, make_inputs, build("Model"), vendor, allow, tolerance)
    if callable(getattr(module, "reference", None)) and callable(getattr(module, "make_inputs", None)):
        def make_plain(seed: int, device: torch.device) -> tuple:
            torch.manual_seed(seed)
            inputs = module.make_inputs(seed, device)
            return tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)

        vendor = (lambda device: module.vendor) if callable(getattr(module, "vendor", None)) else None
        return Problem("function", module, make_plain, lambda device: module.reference, vendor, allow, tolerance)
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(module, n)]
    raise BadInput(f"reference {getattr(module, '__file__', module)} is in neither format: KernelBench needs "
                   f"Model, get_inputs, get_init_inputs (missing {', '.join(missing)}); the plain-function "
                   "format needs reference and make_inputs")


# ----------------------------------------------------------------------------- checks


def tolerance_for(dtype: torch.dtype, override: float | Mapping[torch.dtype, float] | None) -> float:
    """The atol = rtol of one output: the override, else KernelBench's by dtype; 0 (exact) for integers."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    if isinstance(override, (int, float)):
        return float(override)
    if isinstance(override, Mapping) and dtype in override:
        return float(override[dtype])
    return DEFAULT_TOLERANCE.get(dtype, 1e-2)


def _outputs(value: Any) -> list[tuple[str, torch.Tensor]]:
    named = verify.named_tensors("out", value)
    if not named:
        raise TypeError(f"returned {type(value).__name__}, expected a tensor or a tuple of tensors")
    return named


def _compare(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]],
             override: Any) -> tuple[list[str], dict[str, tuple[float, float]]]:
    """(problems, {output: (worst error, tolerance)}): structure, NaN/unwritten, allclose, block-wise calc_diff."""
    if len(got) != len(want):
        return [f"candidate returned {len(got)} tensor(s) {[n for n, _ in got]}, the reference {len(want)}"], {}
    problems, errors = [], {}
    for (name, g), (_, w) in zip(got, want):
        if g.shape != w.shape:
            problems.append(f"{name}: shape {tuple(g.shape)}, reference {tuple(w.shape)}")
            continue
        if g.dtype != w.dtype:
            problems.append(f"{name}: dtype {g.dtype}, reference {w.dtype}")
            continue
        tol = tolerance_for(w.dtype, override)
        if not (w.is_floating_point() or w.is_complex()):
            bad = int((g != w).sum())
            errors[name] = (float(bad), 0.0)
            if bad:
                problems.append(f"{name}: {bad} of {w.numel()} elements differ (integer outputs must match exactly)")
            continue
        g64, w64 = numerics._as_float64(g), numerics._as_float64(w)
        unwritten = int((~torch.isfinite(g64) & torch.isfinite(w64)).sum())
        if unwritten:
            problems.append(f"{name}: {unwritten} of {w.numel()} elements NaN/Inf where the reference is finite "
                            "(unwritten? outputs start NaN-poisoned)")
            errors[name] = (math.inf, tol)
            continue
        if not torch.equal(numerics._nonfinite_code(g64), numerics._nonfinite_code(w64)):
            problems.append(f"{name}: NaN/Inf in other places than the reference's")
            errors[name] = (math.inf, tol)
            continue
        both = torch.isfinite(g64) & torch.isfinite(w64)
        excess = ((g64 - w64).abs() - (tol + tol * w64.abs()))[both]
        n_bad = int((excess > 0).sum())
        diff = numerics.tensor_error(g, w)
        worst = float((g64 - w64)[both].abs().max()) if both.any() else 0.0
        errors[name] = (diff, tol)
        if n_bad:
            problems.append(f"{name}: {n_bad} of {w.numel()} elements outside atol=rtol={tol:g} "
                            f"(max abs error {worst:.3g})")
        elif not diff <= tol:
            problems.append(f"{name}: block-wise calc_diff {diff:.3g} > {tol:g}")
    return problems, errors


def _clone_inputs(inputs: tuple) -> tuple:
    return verify._clone(inputs, {})


def _short_error(exc: BaseException) -> str:
    """The exception's type and message; for a Triton compiler error, its whole (source-pointing) message."""
    text = str(exc).strip()
    if type(exc).__name__ == "CompilationError" or "triton" in type(exc).__module__:
        return f"{type(exc).__name__}: {text[:2000]}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                  if not f.filename.startswith(str(Path(torch.__file__).parent))), "")
    first = text.splitlines()[0][:400] if text else ""
    return f"{type(exc).__name__}: {first}" + (f" (at {where})" if where else "")


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _check_reference_deterministic(problem: Problem, device: torch.device, seed: int, override: Any) -> list:
    """Run the reference twice (fresh builds, same seed); BadInput when the two disagree."""
    outs = []
    for _ in range(2):
        ref = problem.build_reference(device)
        inputs = problem.make_inputs(seed, device)
        try:
            with _no_grad():
                outs.append(_outputs(ref(*inputs)))
        except Exception as exc:
            raise BadInput(f"the reference raised on seed {seed}: {_short_error(exc)}") from None
        synchronize()
    problems, _ = _compare(outs[1], outs[0], override)
    if problems:
        raise BadInput(f"the reference is not deterministic: two runs with seed {seed} differ ({problems[0]})")
    return outs[0]


def _candidate_allow(module: ModuleType, verdict: Verdict) -> dict[str, str]:
    declared = fallback.normalize_allow(getattr(module, "ALLOW", None))
    illegal = sorted(n for n in declared if fallback._base(n) not in fallback.LAYOUT)
    if illegal:
        verdict.fail("no_fallback", f"the candidate allow-lists {', '.join(illegal)}: a candidate may declare "
                     "only layout copies and casts; compute operators need the problem's ALLOW or --allow")
    return {n: r for n, r in declared.items() if n not in illegal}


def verify_candidate(candidate: str | Path | ModuleType, reference: str | Path | ModuleType, *,
                     seeds: int | Sequence[int] = MIN_SEEDS, tolerance: float | None = None,
                     min_speedup: float = 1.0, shapes: Mapping[str, Any] | None = None,
                     allow: Mapping[str, str] | None = None, device: torch.device | None = None,
                     bench: bool = True, progress: Callable[[str, Verdict], None] | None = None) -> Verdict:
    """Run the four gates on one candidate; never raises for a problem with the files (see ``Verdict``).

    ``progress(stage, verdict)`` is called as each stage starts (``STAGES``: the reference is checked, then
    the gates compiles, correct (with no_fallback) and faster), with the verdict so far: the sandbox's
    parent learns from it which gate a candidate that crashes or hangs was in."""
    verdict = Verdict(candidate=str(getattr(candidate, "__file__", candidate)),
                      reference=str(getattr(reference, "__file__", reference)), min_speedup=min_speedup)
    try:
        _verify(verdict, candidate, reference, seeds, tolerance, min_speedup, shapes, allow, device, bench,
                progress or (lambda stage, v: None))
    except BadInput as exc:
        verdict.bad_input = str(exc)
    return verdict


def _verify(verdict: Verdict, candidate, reference, seeds, tolerance, min_speedup, shapes, allow, device,
            bench, progress) -> None:
    progress("reference", verdict)
    device = device or default_device()
    seed_list = verify.fresh_seeds(seeds) if isinstance(seeds, int) else list(seeds)
    if len(seed_list) < 1:
        raise BadInput("seeds: expected at least one")
    if isinstance(seeds, int) and seeds < MIN_SEEDS:
        verdict.notes.append(f"only {seeds} seeds (the gate's standard is at least {MIN_SEEDS})")
    verdict.seeds = seed_list
    integrity = Integrity()
    problem = load_problem(reference, shapes)
    verdict.format = problem.format
    override = tolerance if tolerance is not None else problem.tolerance
    allowed = {**problem.allow, **fallback.normalize_allow(allow)}
    _check_reference_deterministic(problem, device, seed_list[0], override)

    # Gate 1: compiles (import, build, first call).
    progress("compiles", verdict)
    try:
        module = candidate if isinstance(candidate, ModuleType) else load_file(candidate, "candidate")
    except BadInput:
        raise
    except Exception as exc:
        verdict.fail("compiles", f"import failed: {_short_error(exc)}")
        return
    tampered = integrity.check()
    if tampered:
        verdict.fail("no_fallback", f"the candidate replaced {', '.join(tampered)} when imported")
    allowed.update(_candidate_allow(module, verdict))
    try:
        fn, state = problem.build_candidate(module, device)
    except BadInput:
        raise
    except Exception as exc:
        verdict.fail("compiles", f"building the candidate failed: {_short_error(exc)}")
        return
    if problem.format == "kernelbench" and fn.copied_weights:
        verdict.notes.append(f"{fn.copied_weights} parameter/buffer tensor(s) copied from Model into ModelNew")
    reference_fn = problem.build_reference(device)
    try:
        # Recorded like every call, so that a torch.compile'd candidate runs eagerly here too.
        with _no_grad(), fallback.record_call(allow=allowed):
            first = fn(*problem.make_inputs(seed_list[0], device))
            synchronize()
        _outputs(first)
    except Exception as exc:
        verdict.fail("compiles", f"first call failed: {_short_error(exc)}")
        return
    verdict.gates["compiles"] = Gate(PASS, f"built and ran on {backend()}"
                                     + (" (Triton interpreter)" if device.type == "cpu" else ""))

    # Gates 2 and 3: correct and no illegal fall-back, per seed.
    progress("correct", verdict)
    correct_problems: list[str] = []
    fallback_problems: list[str] = []
    launches, operators = [], {}
    # The first seed, then the same inputs again (a result cached by pointer shows), then the rest.
    calls = [(seed_list[0], False), (seed_list[0], True)] + [(s, False) for s in seed_list[1:]]
    inputs_cache: dict[int, tuple] = {}
    for seed, repeat in calls:
        tag = f"seed {seed}" + (" (repeated call, same inputs)" if repeat else "")
        if repeat:
            cand_inputs = inputs_cache[seed]
        else:
            cand_inputs = problem.make_inputs(seed, device)
            inputs_cache[seed] = cand_inputs
        original = _clone_inputs(cand_inputs)
        with _no_grad():
            want = _outputs(reference_fn(*_clone_inputs(cand_inputs)))
        named_inputs = verify.named_tensors("input", cand_inputs) + state
        before = registry.reference_call_counts()
        try:
            with _no_grad(), fallback.record_call([t for _, t in named_inputs], allowed) as rec:
                returned = fn(*cand_inputs)
                synchronize()
            got = _outputs(returned)
        except Exception as exc:
            correct_problems.append(f"{tag}: the candidate raised {_short_error(exc)}")
            break
        tampered = integrity.check()
        if tampered:
            fallback_problems.append(f"{tag}: the candidate replaced {', '.join(tampered)}")
        called = {n: c - before.get(n, 0) for n, c in registry.reference_call_counts().items()
                  if c != before.get(n, 0)}
        if called:
            fallback_problems.append(f"{tag}: called the registered reference "
                                     + ", ".join(f"{n} x{c}" for n, c in sorted(called.items())))
        launches.append(rec.launches)
        for name, count in rec.ops.items():
            operators[name] = max(operators.get(name, 0), count)
        fallback_problems += [f"{tag}: {p}" for p in rec.problems()
                              + fallback.output_problems(rec, got, named_inputs)]
        changed = verify._changed_inputs(verify.named_tensors("input", original),
                                         verify.named_tensors("input", cand_inputs))
        if changed:
            correct_problems.append(f"{tag}: the candidate modified its inputs: {', '.join(changed)}")
        problems, errors = _compare(got, want, override)
        correct_problems += [f"{tag}: {p}" for p in problems]
        for name, (err, tol) in errors.items():
            verdict.tolerances[name] = tol
            verdict.max_errors[name] = max(verdict.max_errors.get(name, 0.0), err)
        if correct_problems and fallback_problems:
            break
    verdict.launches = min(launches) if launches else None
    verdict.operators = operators
    tol_text = ", ".join(f"{n} atol=rtol={t:g}" for n, t in verdict.tolerances.items())
    if correct_problems:
        verdict.fail("correct", "; ".join(correct_problems[:3]))
    else:
        verdict.gates["correct"] = Gate(PASS, f"{len(seed_list)} fresh seeds + 1 repeat within {tol_text}")
    if fallback_problems:
        verdict.fail("no_fallback", "; ".join(dict.fromkeys(fallback_problems[:3])))
    elif verdict.gates["no_fallback"].status != FAIL:
        verdict.gates["no_fallback"] = Gate(PASS, f"{verdict.launches}+ Triton launch(es) per call, outputs "
                                            "written by them; PyTorch ops: "
                                            + (", ".join(sorted(operators)) or "none"))

    # Gate 4: faster.
    if device.type == "cpu":
        verdict.gates["faster"] = Gate(NOT_MEASURABLE, "cpu / Triton interpreter: timings say nothing about a GPU")
        return
    if not (verdict.correct and bench):
        verdict.gates["faster"] = Gate(NOT_RUN, "not timed: " + ("the candidate failed a gate above" if bench
                                                                 else "bench=False"))
        return
    progress("faster", verdict)
    inputs = problem.make_inputs(seed_list[0], device)
    with _no_grad():
        verdict.candidate_ms = do_bench(lambda: fn(*inputs), **verify.GPU_BENCH)
        verdict.reference_ms = do_bench(lambda: reference_fn(*inputs), **verify.GPU_BENCH)
        if problem.build_vendor is not None:
            vendor_fn = problem.build_vendor(device)
            verdict.vendor_ms = do_bench(lambda: vendor_fn(*inputs), **verify.GPU_BENCH)
    with _no_grad():  # unrecorded, like the timed calls: a candidate that cheats only when not watched shows here
        problems, _ = _compare(_outputs(fn(*inputs)), _outputs(reference_fn(*inputs)), override)
    if problems:
        verdict.gates["faster"] = Gate(FAIL, f"an unrecorded call (as timed) gives a different result: {problems[0]}")
        return
    tampered = integrity.check()
    if tampered:
        verdict.fail("no_fallback", f"the candidate replaced {', '.join(tampered)} while being timed")
        verdict.gates["faster"] = Gate(FAIL, "timing cannot be trusted: the harness was tampered with")
        return
    verdict.speedup = verdict.reference_ms / verdict.candidate_ms if verdict.candidate_ms > 0 else math.inf
    if verdict.vendor_ms is not None and verdict.candidate_ms > 0:
        verdict.vendor_speedup = verdict.vendor_ms / verdict.candidate_ms
    text = (f"{verdict.speedup:.3g}x the reference ({verdict.candidate_ms:.4g} ms vs {verdict.reference_ms:.4g} ms"
            + (f"; {verdict.vendor_speedup:.3g}x the vendor path" if verdict.vendor_speedup else "")
            + f"), needs >= {min_speedup:g}x")
    verdict.gates["faster"] = Gate(PASS if verdict.speedup >= min_speedup else FAIL, text)


# ----------------------------------------------------------------------------- reports


def format_verdict(v: Verdict) -> str:
    lines = [f"== {v.candidate} vs {v.reference} ({v.format or '?'} format) =="]
    if v.bad_input:
        lines.append(f"BAD INPUT: {v.bad_input}")
        return "\n".join(lines)
    for name, g in v.gates.items():
        lines.append(f"  {name:<12} {g.status.upper():<15} {g.message or ''}")
    lines += [f"  note: {n}" for n in v.notes]
    lines.append(f"verdict: {'PASS' if v.passed else 'FAIL'}")
    return "\n".join(lines)


def fast_p(verdicts: Sequence[Verdict], p: float) -> float | None:
    """KernelBench's fast_p: share of all candidates correct and faster than p x the reference
    (fast_0 = correctness rate); None when speed was not measurable for a correct candidate."""
    if not verdicts:
        return None
    if p == 0:
        return sum(v.correct for v in verdicts) / len(verdicts)
    if any(v.correct and v.speedup is None for v in verdicts):
        return None
    return sum(v.correct and v.speedup is not None and v.speedup > p for v in verdicts) / len(verdicts)


def suite_summary(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """Per-gate pass rates (passed / measured) and fast_p for p in FAST_P."""
    rates = {}
    for gate in GATES:
        measured = [v for v in verdicts if v.gates[gate].status in (PASS, FAIL)]
        rates[gate] = {"passed": sum(v.gates[gate].status == PASS for v in measured), "measured": len(measured)}
    return {"candidates": len(verdicts), "passed": sum(v.passed for v in verdicts),
            "bad_input": sum(bool(v.bad_input) for v in verdicts), "gates": rates,
            "fast_p": {f"fast_{p:g}": fast_p(verdicts, p) for p in FAST_P}}


def format_suite(verdicts: Sequence[Verdict]) -> str:
    rows = [{"candidate": Path(v.candidate).parent.name + "/" + Path(v.candidate).name,
             **{g: ("BAD INPUT" if v.bad_input else v.gates[g].status) for g in GATES},
             "speedup": v.speedup} for v in verdicts]
    summary = suite_summary(verdicts)
    rate_rows = [{"gate": g, "passed": f"{r['passed']}/{r['measured']}" if r["measured"] else "not measurable"}
                 for g, r in summary["gates"].items()]
    fast = ", ".join(f"{k}={'not measurable' if v is None else f'{v:.2f}'}" for k, v in summary["fast_p"].items())
    return "\n".join([format_table(rows), "", format_table(rate_rows), "", fast,
                      f"passed {summary['passed']}/{summary['candidates']}"])
