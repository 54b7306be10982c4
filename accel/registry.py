"""Kernel registry: each public kernel op resolves to its Triton implementation or its PyTorch reference.

Why: users must always know which code ran. The choice is inspectable per op (``implementation``,
``report``), logged once per op, and ``DSV3_STRICT_KERNELS=1`` turns any fall-back to the
reference into a ``KernelFallbackError`` naming the op and the reason.

Selection (``DSV3_KERNEL_IMPL`` or the ``force`` context): ``auto`` (Triton where it can run,
else the reference), ``triton`` (Triton or an error), ``reference`` (always the reference; an
explicit choice, never a fall-back).

Kernel modules register like this::

    @registry.reference_for("deep_gemm.fp8_gemm_nt")
    def fp8_gemm_nt_reference(...): ...

    fp8_gemm_nt_op = registry.register("deep_gemm.fp8_gemm_nt", reference=fp8_gemm_nt_reference,
                                       triton=fp8_gemm_nt_triton, verify=VerifySpec(...))

(``triton`` may also be ``"package.module:function"``, imported at its first use: the kernel package then
imports without Triton, and the public op reaches the launch through this registry and that function only.)

and front each with a PyTorch custom op ``torch.ops.dsv3.<last part of the name>`` whose body is that
dispatch (``registry.torch_op``; docs/custom_ops.md), and allocate outputs they return through
``registry.empty`` so the verification harness can
poison them with NaN. References wrapped by ``reference_for`` count their calls even when called
directly, which is how the harness proves a kernel did not quietly run the reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from accel.backend import backend as _current_backend
from accel.backend import default_device, triton_interpreted

IMPL_ENV = "DSV3_KERNEL_IMPL"
STRICT_ENV = "DSV3_STRICT_KERNELS"
IMPLS = ("auto", "triton", "reference")

log = logging.getLogger("accel.kernels")


class KernelFallbackError(RuntimeError):
    """A kernel op would have run its reference although the Triton kernel was required."""


class Unsupported(Exception):
    """Raised by a Triton implementation for inputs it cannot handle (the message says why)."""


@dataclass
class Case:
    """One call of an op: its arguments, and which of them are written in place (outputs).

    ``outputs`` holds positions in ``args`` (int) or names in ``kwargs`` (str).
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[int | str, ...] = ()


@dataclass
class VerifySpec:
    """How the verification harness exercises an op.

    make_case(shape, seed, device) -> Case with fresh random inputs for that shape.
    shapes: small shapes the CPU interpreter can run; bench_shapes: realistic GPU shapes.
    compare(got, want) -> {name: (error, tolerance)} over the named result tensors (names: ``out``,
    ``out[0]``... for returned values, the reference's parameter name for in-place outputs); the
    default is ``accel.numerics.tensor_error`` (blockwise calc_diff, equal NaN/Inf positions, integers
    exact) against ``tolerance``.
    flops(shape) / bytes_moved(shape): for TFLOP/s and GB/s columns.
    fp8: the op's FLOPs run on FP8 tensor cores, so its roofline uses the device's FP8 peak.
    allow: PyTorch operators the Triton path may run besides allocation and views (``{"aten.copy_":
    "reason"}``); anything else it runs is an illegal fall-back (``verifier.fallback``).
    """

    make_case: Callable[[dict, int, torch.device], Case]
    shapes: Sequence[dict]
    bench_shapes: Sequence[dict] = ()
    tolerance: float = 1e-5
    compare: Callable[[dict, dict], dict[str, tuple[float, float]]] | None = None
    flops: Callable[[dict], float] | None = None
    bytes_moved: Callable[[dict], float] | None = None
    fp8: bool = False
    allow: dict[str, str] = field(default_factory=dict)
    # why Triton's interpreter here cannot run the kernel (an interpreter gap; the compiled kernel is unaffected), or
    # None: the CPU tests skip the interpreted kernel with that reason instead of failing on the interpreter
    interpreter_gap: Callable[[], str | None] | None = None


_reference_calls: Counter[str] = Counter()
_local = threading.local()


def reference_for(op_name: str) -> Callable[[Callable], Callable]:
    """Decorate an op's PyTorch reference so every call of it is counted under ``op_name``."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            _reference_calls[op_name] += 1
            return fn(*args, **kwargs)

        counted.__reference_op__ = op_name
        return counted

    return wrap


def reference_call_count(op_name: str | None = None) -> int:
    """Calls of one op's reference so far, or of every reference when ``op_name`` is None."""
    return _reference_calls[op_name] if op_name else sum(_reference_calls.values())


def reference_call_counts() -> dict[str, int]:
    """A snapshot of every op's reference call count (the harness diffs two of them)."""
    return dict(_reference_calls)


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0")


def requested_impl() -> str:
    mode = getattr(_local, "forced", None) or os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if mode not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={mode!r} is not a kernel implementation; choose one of {', '.join(IMPLS)}")
    return mode


@contextlib.contextmanager
def force(impl: str) -> Iterator[None]:
    """Within the block (this thread), select ``impl`` ('auto', 'triton' or 'reference') for every op."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; choose one of {', '.join(IMPLS)}")
    previous = getattr(_local, "forced", None)
    _local.forced = impl
    try:
        yield
    finally:
        _local.forced = previous


# looked up once, at import: an op's dispatch asks on every call, also while torch.compile traces it, and torch 2.11's
# dynamo refuses to trace ``importlib.util.find_spec``
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on tensors of ``device``, or None when it can."""
    if not _TRITON_INSTALLED:
        return "the 'triton' package is not installed"
    if device.type == "cpu" and not triton_interpreted():
        return "inputs are on the cpu and TRITON_INTERPRET=1 is not set"
    return None


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, (list, tuple)):
        for item in obj:
            dev = _first_device(item)
            if dev is not None:
                return dev
    if isinstance(obj, dict):
        return _first_device(list(obj.values()))
    return None


class KernelOp:
    """A public kernel op: a counted reference, an optional Triton implementation, a verify spec."""

    def __init__(self, name: str, reference: Callable, triton: Callable | str | None, verify: VerifySpec | None):
        if getattr(reference, "__reference_op__", None) is None:
            reference = reference_for(name)(reference)
        self.name = name
        self.reference = reference
        self._triton = triton
        self.verify = verify
        self._logged: set[tuple[str, str | None]] = set()
        self.custom_op: torch.library.CustomOpDef | None = None  # torch.ops.dsv3.* fronting it (torch_op)
        self.differentiable = False  # the custom op has a registered autograd
        self.last_impl: str | None = None
        self.last_reason: str | None = None

    @property
    def triton(self) -> Callable | None:
        """The Triton implementation (a ``"module:function"`` given at registration is imported now)."""
        if isinstance(self._triton, str):
            module, _, name = self._triton.partition(":")
            self._triton = getattr(importlib.import_module(module), name)
        return self._triton

    def resolve(self, device: torch.device | None = None) -> tuple[str, str | None]:
        """('triton' or 'reference', reason for a fall-back or None) for inputs on ``device``."""
        mode = requested_impl()
        if mode == "reference":
            return "reference", None
        if self._triton is None:
            reason = "no Triton implementation"
        else:
            reason = triton_unavailable_reason(device or default_device())
        if reason is None:
            return "triton", None
        self._fail_or_fallback(reason, mode)
        return "reference", reason

    def _fail_or_fallback(self, reason: str, mode: str) -> None:
        if mode == "triton" or strict():
            if mode != "triton":
                why = f"{STRICT_ENV}=1"
            elif getattr(_local, "forced", None):
                why = "registry.force('triton')"
            else:
                why = f"{IMPL_ENV}=triton"
            raise KernelFallbackError(f"kernel {self.name}: Triton required ({why}) but {reason}")

    def _note(self, impl: str, reason: str | None) -> None:
        self.last_impl, self.last_reason = impl, reason
        if (impl, reason) not in self._logged:
            self._logged.add((impl, reason))
            # A fall-back on a GPU costs real speed: warn. On the cpu it is the normal development path.
            level = logging.WARNING if reason and _current_backend() != "cpu" else logging.INFO
            log.log(level, "kernel %s -> %s%s", self.name, impl, f" ({reason})" if reason else "")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl, reason = self.resolve(_first_device(args) or _first_device(kwargs))
        if impl == "triton":
            try:
                out = self.triton(*args, **kwargs)
            except Unsupported as exc:
                reason = f"Triton kernel does not support these inputs: {exc}"
                self._fail_or_fallback(reason, requested_impl())
            else:
                self._note("triton", None)
                return out
        self._note("reference", reason)
        return self.reference(*args, **kwargs)


_OPS: dict[str, KernelOp] = {}

NAMESPACE = "dsv3"


def wrap_triton(kernel: Any) -> Any:
    """How a kernel launches (``wrap_triton(kernel)[grid](...)``): while ``torch.compile`` traces,
    ``torch.library.wrap_triton(kernel)``, so that the graph holds the launch; otherwise the kernel itself, a plain
    eager launch (as ``triton_op`` does in eager), also where a kernel op is called outside its custom op (the
    verifier, whose operator recorder would otherwise meet a higher-order operator) and under Triton's interpreter
    (torch before 2.12 refuses to wrap an interpreted kernel, pytorch/pytorch#152868; it cannot be traced)."""
    if triton_interpreted() or not torch.compiler.is_compiling():
        return _EagerLaunch(kernel)
    return torch.library.wrap_triton(kernel)


class _EagerLaunch:
    """``kernel[grid](...)`` launched eagerly, except on ``meta`` tensors, where nothing is computed: the wrapper
    around the launch (its checks, allocations, what its op saves for backward) runs as on the device, which is
    what the memory measurement (``planner.memory_measure``) counts."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
                return None
            return launch(*args, **kwargs)

        return run


_BODIES: dict[str, Callable[..., Any]] = {}  # "dsv3::name" -> the op's Python body


def library_op(name: str, *, mutates_args: Sequence[str] = (), triton: bool = False) -> Callable[[Callable], Any]:
    """``torch.library.triton_op`` (``triton``) or ``custom_op`` for ``fn``, named ``name``, its body kept for
    ``body``."""

    def wrap(fn: Callable) -> Any:
        make = torch.library.triton_op if triton else torch.library.custom_op
        op = make(name, fn, mutates_args=tuple(mutates_args))
        _BODIES[name] = fn
        return op

    return wrap


def body(op: Any) -> Callable[..., Any] | None:
    """The Python body of a ``dsv3`` op (an ``OpOverload``), or None for any other op: what the op runs below
    autograd, so that a dispatch mode (the memory meter, ``planner.memory_measure``) can run it and see the
    operators inside, which the op itself hides."""
    return _BODIES.get(op.name()) if getattr(op, "namespace", None) == NAMESPACE else None


def recompute_autograd(grads: Callable[..., Any]) -> tuple[Callable, Callable]:
    """``(backward, setup_context)`` for a one-output op whose backward keeps only its tensor inputs and recomputes
    the rest: ``grads(output's gradient made contiguous, *the op's inputs)`` returns the tensor inputs' gradients
    in order (one tensor for one input); the other inputs (sizes, flags, scales) get None."""

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.tensor_at = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.others = [x for x in inputs if not isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved, others = iter(ctx.saved_tensors), iter(ctx.others)
        out = grads(grad.contiguous(), *(next(saved) if t else next(others) for t in ctx.tensor_at))
        out = iter(out if isinstance(out, tuple) else (out,))
        return tuple(next(out) if t else None for t in ctx.tensor_at)

    return backward, setup_context


def torch_op(kernel: KernelOp, *, mutates_args: Sequence[str] = (), backward: Callable | None = None,
             setup_context: Callable | None = None, recompute: Callable | None = None, fake: Callable | None = None,
             opaque: bool = False) -> Callable[[Callable], Any]:
    """Decorate ``fn``, the op's body (the kernel op called with flat, type-annotated arguments), into the custom
    op ``torch.ops.dsv3.<kernel's last name part>`` and record it as ``kernel.custom_op``.

    With a Triton implementation it is a ``torch.library.triton_op`` (``torch.compile`` traces the body: the
    registry's choice, then the ``wrap_triton`` launch or the reference's torch ops), else a ``custom_op``. Its
    fake implementation is the body on fake tensors with the reference chosen: the reference's shapes, dtypes
    and devices are the kernel's (the verifier checks that), and the Triton interpreter cannot run on fake
    tensors. On ``meta`` tensors (the memory measurement) it is the body as chosen: the Triton path's own
    allocations, its launch a no-op there. ``backward`` / ``setup_context``: its ``register_autograd`` (then
    ``kernel.differentiable``); ``recompute``: instead of those two, the ``grads`` of ``recompute_autograd`` (the
    backward keeps the tensor inputs only). ``fake``: the fake implementation instead, and ``opaque``: a ``custom_op``
    despite a Triton implementation, for an op whose reference reads its inputs' values on the host (a group
    layout, sequence lengths): fake tensors and ``torch.compile`` cannot trace that body, so the op stays one
    opaque node with that fake.
    """

    if recompute is not None:
        if backward is not None or setup_context is not None:
            raise ValueError(f"torch_op({kernel.name!r}): give recompute or backward / setup_context, not both")
        backward, setup_context = recompute_autograd(recompute)

    def wrap(fn: Callable) -> Any:
        name = f"{NAMESPACE}::{kernel.name.rsplit('.', 1)[-1]}"
        op = library_op(name, mutates_args=mutates_args, triton=kernel._triton is not None and not opaque)(fn)

        def reference_fake(*args: Any, **kwargs: Any) -> Any:
            device = _first_device(args) or _first_device(kwargs)
            if device is not None and device.type == "meta":  # the chosen path's host logic; a launch is a no-op
                return fn(*args, **kwargs)
            with force("reference"):
                return fn(*args, **kwargs)

        op.register_fake(fake or reference_fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        kernel.custom_op, kernel.differentiable = op, backward is not None
        return op

    return wrap


def register(
    name: str, reference: Callable, triton: Callable | str | None = None, verify: VerifySpec | None = None
) -> KernelOp:
    """Register (or replace) the op ``name`` and return the dispatching callable."""
    op = KernelOp(name, reference, triton, verify)
    _OPS[name] = op
    return op


def get(name: str) -> KernelOp:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"no kernel op named {name!r}; registered: {', '.join(sorted(_OPS)) or 'none'}") from None


def unregister(name: str) -> None:
    """Remove the op ``name`` (tests register throw-away ops and remove them afterwards)."""
    get(name)
    del _OPS[name]


def ops() -> list[str]:
    """Names of every registered op (import the kernel packages first to register theirs)."""
    return sorted(_OPS)


KERNEL_PACKAGES = ("deep_gemm", "flash_mla", "fused_ce", "fused_ops")


def import_kernel_packages(packages: Sequence[str] = KERNEL_PACKAGES) -> dict[str, str | None]:
    """Import each kernel package so that its ops register; per package, None or why it failed.

    A package that is not installed at all is reported, not raised; an error inside a package
    (a missing dependency, a syntax error) is reported with its type, never swallowed.
    """
    status: dict[str, str | None] = {}
    for pkg in packages:
        try:
            importlib.import_module(pkg)
        except ModuleNotFoundError as exc:
            status[pkg] = "not installed" if exc.name == pkg else f"ModuleNotFoundError: {exc}"
        except Exception as exc:  # reported to the caller with its type
            status[pkg] = f"{type(exc).__name__}: {exc}"
        else:
            status[pkg] = None
    return status


def load_all() -> list[str]:
    """Import the toolkit's kernel packages so that their ops are registered; return the op names.

    Raises ImportError when a package exists but fails to import (an absent package is skipped).
    """
    failed = {pkg: why for pkg, why in import_kernel_packages(KERNEL_PACKAGES).items()
              if why and why != "not installed"}
    if failed:
        raise ImportError("kernel packages failed to import: " + "; ".join(f"{p}: {w}" for p, w in failed.items()))
    return ops()


def implementation(name: str, device: torch.device | None = None) -> str:
    """Which implementation ``name`` would run for inputs on ``device``: 'triton' or 'reference'."""
    return get(name).resolve(device)[0]


def report(device: torch.device | None = None) -> dict[str, dict[str, str | None]]:
    """Per op: the implementation it would run now and, for a fall-back, why."""
    out = {}
    for name in ops():
        try:
            impl, reason = get(name).resolve(device)
        except KernelFallbackError as exc:
            impl, reason = "error", str(exc)
        out[name] = {"impl": impl, "reason": reason}
    return out


def poison_value(dtype: torch.dtype) -> float | int:
    """The value unwritten outputs are filled with: NaN for floats, the maximum for integers, True for bool."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, ``empty`` returns tensors filled with NaN (ints: their max), so unwritten
    output elements show up."""
    previous = getattr(_local, "poison", False)
    _local.poison = True
    try:
        yield
    finally:
        _local.poison = previous


def empty(*shape: int | Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; NaN-filled inside ``poisoned_outputs``."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    t = torch.empty(shape, dtype=dtype, device=device)
    if getattr(_local, "poison", False):
        fill(t, poison_value(dtype))
    return t


# NaN's byte in each fp8 format: poisoning fills bytes, one fill_ that verifier.fallback counts as allocation.
_FP8_NAN_BYTE = {dtype: int(torch.tensor(float("nan")).to(dtype).view(torch.uint8))
                 for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}


def fill(t: torch.Tensor, value: float | int) -> torch.Tensor:
    """Fill in place; works for fp8 dtypes too (which lack a fill kernel on some builds)."""
    if t.dtype in _FP8_NAN_BYTE and value != value:  # NaN
        t.view(torch.uint8).fill_(_FP8_NAN_BYTE[t.dtype])
    elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.copy_(torch.full(t.shape, value, dtype=torch.float32, device=t.device))
    else:
        t.fill_(value)
    return t
