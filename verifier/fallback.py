"""The "no illegal fall-back" gate: record every PyTorch operator and every Triton launch inside one call.

A kernel under test may allocate, take views and (when declared) copy or cast; everything else it
computes must come from its own kernel launches. ``record_call()`` proves that with two recorders:

- a ``TorchDispatchMode`` that sees every ATen operator the call runs (``torch.*``, ``F.*``, tensor
  methods, and ``torch.compile``d functions, which run eagerly under an active dispatch mode), and
  fills every ``empty`` allocation with NaN (integers: their maximum) so an unwritten element shows;
- a hook on ``JITFunction.run`` / ``InterpretedFunction.run`` that counts Triton launches and notes
  which tensors each launch received, on which thread and device stream.

From both it tracks who last wrote each storage ("provenance"), so the harness can tell an output
written by the candidate's kernel from one computed by ``torch.matmul`` after a no-op launch, from a
cached tensor (not allocated in this call) and from an input handed back. Operators that run inside
a launch are the interpreter's own plumbing (copies to and from the host) and are allowed only when
they are layout operations: a kernel body cannot hide ``torch.matmul`` inside the interpreter.

Operator names are ATen overload packets, ``aten.mm``; allow-lists map such names to a reason.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from accel import registry
from accel.backend import backend, current_stream

# Always allowed: allocation, factory functions (they read no tensor, so they cannot compute a result
# from the inputs) and metadata. Views are allowed too (from the operator's schema, ``OpOverload.is_view``).
ALLOCATION = frozenset({"arange",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor", "fill_", "zero_",
    "lift_fresh", "lift_fresh_copy", "set_", "resize_", "record_stream",
})
METADATA = frozenset({"_unsafe_view", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
                      "sym_storage_offset", "is_same_size", "is_nonzero"})
# Allowed when declared (by the candidate, the problem or the op's VerifySpec): moving bytes, not computing.
LAYOUT = frozenset({"copy_", "clone", "_to_copy", "contiguous", "_copy_from", "_copy_from_and_resize"})
_POISONED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})

# Allow-list for the harness's own tests, where plain PyTorch stands in for a kernel after one marker
# launch: nothing is flagged and outputs count as the kernel's. Never for a real op.
ALLOW_ANY = {"*": "a harness self-test: PyTorch stands in for the kernel"}

KERNEL = "kernel launch"
ALLOCATED = "allocated"
INPUT = "input"
BEFORE = "a tensor from before the call"


def op_name(func: Any) -> str:
    """``aten.mm`` for ``aten.mm.default``: the name allow-lists and reports use."""
    namespace, _, name = func._schema.name.partition("::")
    return f"{namespace}.{name}"


def normalize_allow(allow: Mapping[str, str] | None) -> dict[str, str]:
    """Allow-list keys as ``aten.NAME`` (accepts ``mm``, ``aten.mm``, ``aten.mm.default``, ``torch.ops.aten.mm``)."""
    out = {}
    for key, reason in (allow or {}).items():
        if not isinstance(key, str) or not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"allow-list entry {key!r}: expected 'aten.op_name': 'reason', got {reason!r}")
        if key == "*":
            out[key] = reason
            continue
        name = key.removeprefix("torch.ops.")
        parts = name.split(".")
        name = ".".join(parts[:2]) if len(parts) >= 2 else f"aten.{parts[0]}"
        out[name] = reason
    return out


def _base(name: str) -> str:
    return name.split(".", 1)[-1]


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


@dataclass
class Record:
    """What one call ran: operators (by name, with counts), launches, and the write history of storages."""

    ops: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)  # not allowed, with counts
    in_launch_violations: Counter[str] = field(default_factory=Counter)
    launches: int = 0
    foreign_threads: int = 0  # launches from a thread other than the caller's
    side_stream_launches: int = 0
    threads_started: int = 0
    provenance: dict[int, str] = field(default_factory=dict)
    input_keys: set[int] = field(default_factory=set)  # storages of the call's inputs
    launched_kernels: Counter[str] = field(default_factory=Counter)

    def writer(self, t: torch.Tensor) -> str | None:
        """Who last wrote ``t``'s storage during the call: KERNEL, ALLOCATED, INPUT, an operator, or None."""
        key = _storage_key(t)
        return self.provenance.get(key) if key is not None else KERNEL

    def problems(self) -> list[str]:
        """Violations as sentences naming the operators (empty when the call was clean)."""
        out = []
        if self.violations:
            out.append("PyTorch computed inside the candidate: " + ", ".join(
                f"{n} x{c}" for n, c in sorted(self.violations.items())) + " (not allocation, a view or allow-listed)")
        if self.in_launch_violations:
            out.append("PyTorch ran inside a Triton launch: " + ", ".join(
                f"{n} x{c}" for n, c in sorted(self.in_launch_violations.items())))
        if self.foreign_threads:
            out.append(f"{self.foreign_threads} Triton launch(es) came from another thread (work must run in the "
                       "caller's thread, or the timed region ends before it does)")
        if self.side_stream_launches:
            out.append(f"{self.side_stream_launches} Triton launch(es) went to a side stream, not the caller's "
                       "current stream (the timed region would end before the work does)")
        if self.threads_started:
            out.append(f"the candidate started {self.threads_started} thread(s) during the call")
        return out


class _Recorder(TorchDispatchMode):
    def __init__(self, record: Record, allow: Mapping[str, str], poison: bool):
        super().__init__()
        self.record, self.allow, self.poison = record, allow, poison
        self.in_launch = 0

    def _classify(self, func: Any, name: str) -> str:
        base = _base(name)
        if base in ALLOCATION:
            return "allocation"
        if func.is_view or base in METADATA or func._schema.name.startswith("prim::"):
            return "view"
        if base in LAYOUT:
            return "layout"
        return "compute"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        kind = self._classify(func, name)
        if not self.in_launch:
            self.record.ops[name] += 1
        allowed = kind in ("allocation", "view") or name in self.allow or "*" in self.allow
        if self.in_launch:
            if kind == "compute" and name not in self.allow and "*" not in self.allow:
                self.record.in_launch_violations[name] += 1
        elif not allowed:
            self.record.violations[name] += 1
        out = func(*args, **kwargs)
        if self.in_launch:
            return out
        if self.poison and _base(name) in _POISONED:
            for t in _tensors(out):
                if t.numel():
                    registry.fill(t, registry.poison_value(t.dtype))
        self._note_writes(func, kind, name, args, kwargs, out)
        return out

    def _note_writes(self, func, kind, name, args, kwargs, out) -> None:
        base = _base(name)
        if kind == "view" or base == "set_":
            return
        prov = self.record.provenance
        if kind == "allocation":
            label = ALLOCATED
        elif "*" in self.allow and kind == "compute":
            label = KERNEL if self.record.launches else name
        elif base == "copy_":  # the destination now holds the source's data
            label = prov.get(_storage_key(args[1]), BEFORE)
        elif kind == "layout" or name in self.allow:
            # A cast or an allow-listed op passes on where its data came from.
            sources = [prov.get(_storage_key(t)) for t in _tensors((args, kwargs))]
            label = KERNEL if KERNEL in sources else next((s for s in sources if s and s != ALLOCATED), BEFORE)
        else:
            label = name
        written = [t for a, value in zip(func._schema.arguments, list(args) + [
            kwargs.get(a.name) for a in func._schema.arguments[len(args):]])
            if a.alias_info is not None and a.alias_info.is_write for t in _tensors(value)]
        for t in written or _tensors(out):
            key = _storage_key(t)
            if key is not None:
                prov[key] = label


def _launch_hook(run: Any, state: dict) -> Any:
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode, record = state.get("mode"), state.get("record")
        if record is None or kwargs.get("warmup", False):
            return run(self, *args, **kwargs)
        record.launches += 1
        record.launched_kernels[getattr(getattr(self, "fn", self), "__name__", "kernel")] += 1
        if threading.get_ident() != state["thread"]:
            record.foreign_threads += 1
        if state["stream"] is not None and current_stream() != state["stream"]:
            record.side_stream_launches += 1
        if mode is not None:
            mode.in_launch += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            if mode is not None:
                mode.in_launch -= 1
            for t in _tensors((args, kwargs)):
                key = _storage_key(t)
                # An input handed to a (no-op) launch stays an input: a launch cannot launder it.
                if key is not None and key not in record.input_keys:
                    record.provenance[key] = KERNEL

    return launch


@contextlib.contextmanager
def _hooked_launches(state: dict) -> Iterator[None]:
    try:
        from triton.runtime import interpreter as _interpreter
        from triton.runtime import jit as _jit
    except ImportError:
        yield
        return
    patched = []
    for cls in (_jit.JITFunction, _interpreter.InterpretedFunction):
        run = cls.__dict__.get("run")
        if run is not None:
            cls.run = _launch_hook(run, state)
            patched.append((cls, run))
    try:
        yield
    finally:
        for cls, run in patched:
            cls.run = run


@contextlib.contextmanager
def _counted_thread_starts(record: Record) -> Iterator[None]:
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        record.threads_started += 1
        original(self)

    threading.Thread.start = start
    try:
        yield
    finally:
        threading.Thread.start = original


@contextlib.contextmanager
def record_call(inputs: Any = (), allow: Mapping[str, str] | None = None, poison: bool = True) -> Iterator[Record]:
    """Record the operators and launches of the code run inside the block.

    inputs: the tensors handed to the call (their storages start as ``INPUT``); allow: operator
    name -> reason, on top of allocation and views; poison: fill ``empty`` allocations with NaN.
    """
    record = Record()
    for t in _tensors(inputs):
        key = _storage_key(t)
        if key is not None:
            record.provenance[key] = INPUT
            record.input_keys.add(key)
    mode = _Recorder(record, normalize_allow(allow), poison)
    state = {"mode": mode, "record": record, "thread": threading.get_ident(),
             "stream": current_stream() if backend() != "cpu" else None}
    with _hooked_launches(state), _counted_thread_starts(record), mode:
        yield record
    state["record"] = None  # a thread left running cannot write into a finished record


def output_problems(record: Record, outputs: list[tuple[str, torch.Tensor]],
                    inputs: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Why an output was not written by the candidate's own kernel in this call (empty when it was)."""
    input_keys = {_storage_key(t): name for name, t in inputs if t.numel()}
    problems = []
    if record.launches == 0:
        problems.append("the candidate launched no Triton kernel")
    seen = set()
    for name, t in outputs:
        key = _storage_key(t)
        if not t.numel() or key in seen:  # an in-place output that is also returned is judged once
            continue
        seen.add(key)
        if key in input_keys:
            problems.append(f"{name} shares memory with input {input_keys[key]} (returns an input or a view of one)")
            continue
        writer = record.writer(t)
        if writer is None:
            problems.append(f"{name} was not allocated in this call (a cached or global tensor)")
        elif writer == ALLOCATED:
            problems.append(f"{name} was allocated but never written by a kernel launch")
        elif writer in (INPUT, BEFORE):
            problems.append(f"{name} is a copy of {'an input' if writer == INPUT else writer} (cached or "
                            "hard-coded?), not a kernel's result")
        elif writer != KERNEL:
            problems.append(f"{name} was produced by {writer}, not by the candidate's kernel")
    return problems
