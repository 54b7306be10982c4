"""What the model's pieces keep for backward and their transient peaks, measured by running them.

The memory model (``planner.memory``) takes its activation bytes from here instead of a hand-kept list
of saved tensors: each piece (one ``Block``, its attention half, the routed experts of one expert-parallel
rank, an MTP module's input projection, a loss head) runs forward and backward at the layout's real shapes
on the ``meta`` device, where nothing is allocated and a V3 layer takes milliseconds. A change to the model changes the
estimate by itself.

``LiveBytes`` (a ``TorchDispatchMode``) counts what stays *alive*, not what autograd's hooks see, so any mechanism
that keeps or frees memory is measured as it behaves: every storage an op creates inside the block is tracked (by
storage identity, so views count once) at the size it was made with until it dies (a finalizer on the storage);
nothing in the project resizes a storage. After a piece's forward, the bytes still alive that its outputs do not
account for are its saved-for-backward bytes; the highest count during its forward and backward, less those, is its
transient.

Running on ``meta``:

- accelerator path: the GPU kernels' Python wrappers run as on a Hopper GPU (``_as_gpu``: the registry's
  automatic choice, which is Triton for a non-CPU device; ``accel.planning_for(accel.HOPPER)``: FP8 tensor
  cores, 132 SMs), so each saves exactly what the GPU path saves (flash attention: q, k, v, out, lse; the FP8
  GEMMs their e4m3 casts); a Triton launch on meta tensors does nothing (``registry.wrap_triton``).
  Nothing of torch, Triton or the project is patched. The CPU path forces the PyTorch references
  (``accel.registry.force("reference")``), as a CPU run uses them.
- values: integer tensors (indices, masks) are meta tensors whose values ``LiveBytes`` computes alongside on
  the CPU (``LiveBytes.values``) whenever every input of the op has known values; an op whose meta kernel
  cannot know its output's shape (``nonzero``, ``bincount``, a boolean mask) takes it from those values.
  So the model's host syncs on indices (``int(...)``, ``.tolist()``, ``.item()``) run unchanged; a host read
  of a tensor without values (a float) raises, naming it.
- routing: the router's top-k gets balanced values (token t's j-th choice is expert ``(t k + j) mod E``, so
  every expert gets ``T k / E`` rows, padded to 128 by the model's own permute).
- parameters carry an fp32 ``main_grad`` buffer made before measuring (``accel.grads.keep_main_grads``):
  weight gradients land in buffers that the memory model counts as its ``gradients`` item, not here.

Every measurement is cached by what determines it (model arguments, shapes, path), so a planner that asks
for thousands of layouts measures each distinct piece once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

import accel
from accel import registry
from accel.grads import keep_main_grads
from deep_gemm.utils import unchecked_scale_values
from models.deepseek_v3 import Block, ModelArgs
from models.deepseek_v3.model import head_loss
from models.deepseek_v3.moe import Experts
from models.deepseek_v3.mtp import MTPModule
from models.deepseek_v3.rope import rope_cos_sin
from models.deepseek_v4 import ModelArgs as V4Args
from models.deepseek_v4.model import Block as V4Block
from models.deepseek_v4.model import Gate as V4Gate
from models.deepseek_v4.model import HCHead as V4HCHead
from models.deepseek_v4.model import MTPBlock as V4MTPBlock
from models.deepseek_v4.model import RMSNorm as V4RMSNorm
from models.deepseek_v4.model import rope_angles
from training.memory_policy import MemoryPolicy

META = torch.device("meta")
ALIGNMENT = 128  # rows per expert block of the contiguous grouped layout (deep_gemm.get_m_alignment_...)


# ---- the meter ----------------------------------------------------------------------------------------

def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (an op's arguments or outputs; faster than torch's pytree,
    which a planner's thousands of measured ops would feel)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _map(fn, obj, leaves: tuple[type, ...] = (torch.Tensor,)):
    """``obj`` with ``fn`` applied to every ``leaves`` instance in it (nested tuples, lists and dicts)."""
    if isinstance(obj, leaves):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(fn, item, leaves) for item in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v, leaves) for k, v in obj.items()}
    return obj


def _storages(obj) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in _tensors(obj)]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the block that are alive now (``live``) and at most (``peak``).

    A storage is counted from the op that creates it (an output whose storage is none of the op's inputs')
    until it dies (a finalizer on it), at the size it was made with. Storages are told apart by identity:
    ``Tensor.untyped_storage()`` is one Python object for the storage's whole life, shared by its views.
    Storages that existed before the block (parameters, inputs made outside) are never counted. Works on real
    tensors too (the tests compare it with the CPU allocator).
    ``mark()`` restarts the peak from the current count.
    """

    def __init__(self, balanced_topk: bool = True):
        super().__init__()
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it (of the storages alive)
        self.live = 0  # bytes counted now
        self.peak = 0
        self.balanced_topk = balanced_topk
        self.values = WeakIdKeyDictionary()  # meta integer tensor -> its values (a CPU tensor)

    # tracking
    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        n = storage.nbytes()
        self.sizes[key] = n
        self.live += n
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def mark(self) -> int:
        """Restart the peak from the bytes counted now."""
        self.peak = self.live
        return self.live

    def bytes_of(self, obj) -> int:
        """Counted bytes of the distinct storages of the tensors in ``obj``."""
        seen = {id(s) for s in _storages(obj)}
        return sum(self.sizes.get(k, 0) for k in seen)

    # dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = registry.body(func)
        if body is not None:  # a kernel op: its body, with this mode on, so that what it allocates inside counts
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            if _COMPOSITE.get(func, True):
                # inside a kernel op's body (below autograd) a composite op (``Tensor.to``) is not decomposed yet:
                # its decomposition, seen op by op (``decompose`` runs nothing for any other op)
                with self:
                    out = func.decompose(*args, **(kwargs or {}))
                _COMPOSITE[func] = out is not NotImplemented
                if _COMPOSITE[func]:
                    return out
            out = self._run(func, args, kwargs or {})
        inputs = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = id(storage)
            if key not in self.sizes and key not in inputs:
                self._track(storage)
        self.peak = max(self.peak, self.live)
        return out

    def _run(self, func, args, kwargs):
        """``func`` on meta, with the real values of integer tensors alongside (``self.values``)."""
        values = self.values
        tensors = _tensors((args, kwargs))
        metas = [t for t in tensors if t.is_meta]
        if func is aten._to_copy.default and args[0].is_meta and kwargs.get("device") == CPU:  # .tolist(), .cpu()
            return self._value(args[0]).to(dtype=kwargs.get("dtype"), copy=True)
        if func is aten._local_scalar_dense.default and args[0].is_meta:  # .item(), int(), bool()
            return self._value(args[0]).item()
        if func in _INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            args = (args[0], [j for i in args[1] for j in self._positions(i)], *args[2:])  # a mask's positions
        if func is aten._to_copy.default and not args[0].is_meta and kwargs.get("device") == META:
            out = func(*args, **kwargs)
            if _integral(out):
                values[out] = args[0]
            return out
        real = None
        if func in _FACTORIES:  # an index or mask made from a shape (on meta): made on the CPU too
            known = kwargs.get("device", args[0].device if metas else None) == META and \
                _factory_integral(func, args, kwargs)
        else:  # only integer tensors whose values are known
            known = bool(metas) and all(t in values for t in metas)
        if known:
            # only integer tensors (or none) with known values: the same op on their values, on the CPU
            cpu_args, cpu_kwargs = _map(self._cpu, (args, kwargs), (torch.Tensor, torch.device))
            real = func(*cpu_args, **cpu_kwargs)
        if metas and len(metas) < len(tensors):
            # a real (CPU) tensor meets meta ones: it joins them on meta
            args, kwargs = _map(lambda t: t.to(META), (args, kwargs))
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            if real is None:
                raise
            # a data-dependent shape (nonzero, bincount, a boolean mask): take it from the values
            out = _map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=META), real)
        if real is None and func._schema.is_mutable:  # written from unknown values: its own are unknown now
            for t in metas:
                values.pop(t, None)
        if real is not None:
            for o, r in zip(_tensors(out), _tensors(real)):
                if o.is_meta:
                    values[o] = r
        if func is aten.topk.default and self.balanced_topk and out[1] not in values:
            values[out[1]] = _balanced_choice(out[1].shape, args[0].shape[args[2] if len(args) > 2 else -1])
        return out

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        if t not in self.values:
            raise RuntimeError(f"planner.memory_measure: the model reads the value of a {t.dtype} meta tensor of "
                               f"shape {tuple(t.shape)} on the host (item(), int(), .tolist()); only integer tensors "
                               "made from known integers (indices, the router's top-k) have values here")
        return self.values[t]

    def _cpu(self, x):
        if isinstance(x, torch.Tensor) and x.is_meta:  # a factory's template needs no values: a 0-byte stand-in
            return self.values[x] if x in self.values else torch.empty((), dtype=x.dtype).expand(x.shape)
        return CPU if isinstance(x, torch.device) and x == META else x

    def _positions(self, index) -> tuple:
        if not (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
            return (index,)
        mask = self._value(index) if index.is_meta else index
        out = []
        for p in mask.nonzero().unbind(1):
            m = p.to(META) if index.is_meta else p
            if index.is_meta:
                self.values[m] = p
            out.append(m)
        return tuple(out)


aten = torch.ops.aten
CPU = torch.device("cpu")
_COMPOSITE: dict = {}  # op -> whether it is a composite (decomposes into other ops)
# ops that make a tensor from a shape (and a template's dtype): integer/bool ones get values, on the CPU
_FACTORIES = {aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default,
              aten.arange.start, aten.arange.start_step, aten.empty_strided.default, aten.scalar_tensor.default,
              aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
              aten.new_empty.default, aten.new_zeros.default, aten.new_full.default, aten.new_ones.default,
              aten.new_empty_strided.default}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _factory_integral(func, args, kwargs) -> bool:
    """Whether a factory op makes an index or mask: its dtype, else its template's, else as torch infers it
    (arange of ints, full of an int: int64; a shape alone: the default float)."""
    dtype = kwargs.get("dtype")
    if dtype is None:
        template = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if template is not None and func not in (aten.full.default, aten.new_full.default):
            return template.dtype in (torch.int32, torch.int64, torch.bool)
        if func in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            return all(isinstance(a, int) for a in args)
        if func in (aten.full.default, aten.new_full.default):
            return isinstance(args[-1], (int, bool))
        return False
    return dtype in (torch.int32, torch.int64, torch.bool)


def _integral(t: torch.Tensor) -> bool:
    """An index or mask (not the empty byte tensors torch makes to view a storage)."""
    return t.dtype in (torch.int32, torch.int64, torch.bool) and t.numel() > 0


def _balanced_choice(shape: torch.Size, n: int) -> torch.Tensor:
    """Top-k indices ``[..., k]`` over ``n`` choices, as a CPU tensor: row r's j-th is ``(r k + j) mod n``."""
    k = shape[-1]
    rows = math.prod(shape[:-1])
    return (torch.arange(rows * k) % n).view(shape)


@contextlib.contextmanager
def _as_gpu() -> Iterator[None]:
    """The kernels' host logic as on a Hopper GPU (``accel.HOPPER``: FP8 tensor cores, 132 multiprocessors), with
    the registry's automatic choice (Triton for a non-CPU device, whatever ``DSV3_KERNEL_IMPL`` says here)."""
    with accel.planning_for(accel.HOPPER), registry.force("auto"):
        yield


# ---- one piece ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """One piece run once forward and backward: ``saved`` bytes alive after its forward besides its outputs,
    ``transient`` the most bytes alive on top of those during its forward or backward."""

    saved: int
    transient: int

    def swap(self, out: Measured, into: Measured) -> Measured:
        """This piece with its part ``out`` replaced by ``into`` (both measured alone): what each keeps and its
        transient on top, exchanged."""
        return Measured(self.saved - out.saved + into.saved, self.transient - out.transient + into.transient)

    def then(self, other: Measured) -> Measured:
        """This piece, then ``other`` (on its output): both keep their bytes; each runs on top of both."""
        return Measured(self.saved + other.saved, max(self.transient, other.transient))


def stage_totals(stages: list[list[tuple[str, Measured]]]) -> tuple[list[int], list[int], dict[str, int]]:
    """Per-stage activation totals from each stage's ``(kind, Measured)`` pieces, as the memory model uses them
    (V3's and V4's alike): the bytes one micro-batch keeps on each stage (the pieces' saved bytes summed), the
    most bytes alive on top of those while one of its pieces runs (the largest transient; 0 for a stage without
    pieces), and per kind of piece the largest bytes one micro-batch keeps in it, over all stages."""
    saved, work, detail = [], [], {}
    for pieces in stages:
        saved.append(sum(m.saved for _, m in pieces))
        work.append(max((m.transient for _, m in pieces), default=0))
        for kind, m in pieces:
            detail[kind] = max(detail.get(kind, 0), m.saved)
    return saved, work, detail


def measure(piece: Callable[..., object], inputs: list[torch.Tensor], accelerator: bool,
            params: list[torch.Tensor] = (), own_inputs: bool = True) -> Measured:
    """Run ``piece(*copies)`` forward, then backward from gradients of its floating outputs, inside
    ``LiveBytes``; ``copies`` are made inside (so an input the graph keeps is counted as saved; with
    ``own_inputs=False`` they are made before the count starts: the input is another piece's to count) from
    ``inputs`` (which require grad when their gradient flows). ``params`` get ``main_grad`` buffers first."""
    keep_main_grads([p for p in params if p.requires_grad and not hasattr(p, "main_grad")])
    impl = _as_gpu() if accelerator else registry.force("reference")
    meter = LiveBytes()
    # the training step skips the FP8 GEMMs' scale-value checks too (its scales come from its own casts)
    with impl, unchecked_scale_values():
        with contextlib.nullcontext() if own_inputs else LiveBytes() as outside:
            copies = None if own_inputs else _copies(inputs)
        if outside is not None:  # the integers' values travel with them
            meter.values.update(outside.values)
        with meter:
            if copies is None:
                copies = _copies(inputs)
            out = piece(*copies)
            del copies
            outputs = _tensors(out)
            out_bytes = meter.bytes_of(outputs)
            saved = meter.live - out_bytes
            forward_peak = meter.peak
            diff = [t for t in outputs if t.requires_grad]
            grads = [torch.ones_like(t) for t in diff]
            meter.mark()
            torch.autograd.backward(diff, grads)
            backward_peak = meter.peak
            del out, outputs, diff, grads
    return Measured(saved, max(0, max(forward_peak, backward_peak) - saved - out_bytes))


def _copies(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() if x.is_floating_point() else x.to(META) for x in inputs]  # integers keep their values


# ---- the model's pieces -------------------------------------------------------------------------------

def _dtype(act: float) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[int(act)]


def attention_piece(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention half of a block, ``x + attn(attn_norm(x))`` (the one place that names it)."""
    return block.attention(x, cos, sin)


def _layer_args(args: ModelArgs, layer_id: int) -> tuple[ModelArgs, int]:
    """Arguments and a layer id that behave as ``layer_id`` (same kind, same recompute), normalised so that
    layers alike share one cache entry."""
    kinds = tuple(k for k in ("norm", "mla_up", "swiglu", "block") if args.recomputes(k, layer_id))
    moe = args.is_moe_layer(layer_id)
    return args.replace(recompute=kinds, recompute_layers=None), (args.n_dense_layers if moe else 0)


def _hidden(args: ModelArgs, micro_batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(micro_batch, seq, args.dim, device=META, dtype=dtype, requires_grad=True)


def _rope(args: ModelArgs, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(args, torch.arange(seq))
    return cos.to(META), sin.to(META)


def _cached(fn):
    """``functools.lru_cache`` keyed by ``repr`` of the model arguments (``ModelArgs`` is not hashable)."""
    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(args: ModelArgs, *rest):
        key = (repr(args), *rest)
        if key not in cache:
            cache[key] = fn(args, *rest)
        return cache[key]

    wrapper.cache_clear = cache.clear
    return wrapper


def _build(make: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    with torch.device(META):
        module = make()
    return module.to(dtype).train()


@_cached
def _block(args: ModelArgs, layer_id: int, micro_batch: int, seq: int, act: float, accelerator: bool,
           part: str) -> Measured:
    dtype = _dtype(act)
    block = _build(lambda: Block(args, layer_id), dtype)
    cos, sin = _rope(args, seq, dtype)
    policy = MemoryPolicy(block, args)  # as the trainer applies it, whole-block recompute included
    if part == "attention":
        fn = lambda x: attention_piece(block, x, cos, sin)  # noqa: E731
    else:
        fn = lambda x: policy.recomputed(block, block)(x, cos, sin)  # noqa: E731
    return measure(_under(policy, fn), [_hidden(args, micro_batch, seq, dtype)], accelerator, list(block.parameters()))


def _under(policy: MemoryPolicy, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` run inside the memory policy (what the trainer applies to the model)."""
    def run(*args):
        with policy.applied():
            return fn(*args)

    return run


def block(args: ModelArgs, layer_id: int, micro_batch: int, seq: int, act: float, accelerator: bool) -> Measured:
    """One whole ``Block`` (all routed experts on this rank: expert parallelism is ``experts``' correction)."""
    return _block(*_layer_args(args, layer_id), micro_batch, seq, act, accelerator, "block")


def attention(args: ModelArgs, layer_id: int, micro_batch: int, seq: int, act: float,
              accelerator: bool) -> Measured:
    """The attention half of a block (``attention_piece``)."""
    largs, lid = _layer_args(args, layer_id)
    if largs.recomputes("block", lid):  # inside a recomputed block nothing of its own is kept
        return Measured(0, 0)
    return _block(largs, lid, micro_batch, seq, act, accelerator, "attention")


def expert_rows(args: ModelArgs, tokens: int, slots: int) -> int:
    """Rows of the grouped expert GEMMs on one EP rank under balanced routing: each of the ``ep`` ranks sends
    ``tokens k`` rows over all ``slots x ep`` expert slots, so each local slot gets ``tokens k / slots`` rows,
    padded to ``ALIGNMENT`` (the model's ``permute`` pads each expert's rows the same way)."""
    per_expert = tokens * args.n_activated_experts / slots if slots else 0.0
    return slots * ALIGNMENT * max(1, math.ceil(per_expert / ALIGNMENT)) if per_expert else 0


@_cached
def _experts(args: ModelArgs, slots: int, rows: int, act: float, accelerator: bool) -> Measured:
    dtype = _dtype(act)
    ids = tuple(i % args.n_routed_experts for i in range(slots))
    experts = _build(lambda: Experts(args, ids), dtype)
    per = rows // slots
    m_indices = torch.arange(slots, dtype=torch.int32).repeat_interleave(per)  # balanced: full blocks, no padding
    x = torch.empty(rows, args.dim, device=META, dtype=dtype, requires_grad=True)
    w = torch.empty(rows, device=META, dtype=torch.float32, requires_grad=True)
    policy = MemoryPolicy(experts, args, layer_id=args.n_dense_layers)
    return measure(_under(policy, lambda x, m, w: experts(x, m, w)), [x, m_indices, w], accelerator,
                   list(experts.parameters()))


def experts(args: ModelArgs, layer_id: int, tokens: int, slots: int, act: float, accelerator: bool) -> Measured:
    """The routed experts of one rank (``Experts.forward``) on the rows balanced routing gives ``slots`` slots,
    with the routing weight of each row, as the MoE passes them."""
    # only the SwiGLU recompute reaches the experts: layouts that differ in other kinds share the measurement
    largs = args.replace(recompute=("swiglu",) if args.recomputes("swiglu", layer_id) else (), recompute_layers=None)
    rows = expert_rows(args, tokens, slots)
    return _experts(largs, slots, rows, act, accelerator) if rows else Measured(0, 0)


@_cached
def _projection(args: ModelArgs, depth: int, micro_batch: int, seq: int, act: float, accelerator: bool) -> Measured:
    dtype = _dtype(act)
    module = _build(lambda: MTPModule(args, depth), dtype)
    h, emb = _hidden(args, micro_batch, seq, dtype), _hidden(args, micro_batch, seq, dtype)
    return measure(_under(MemoryPolicy(module, args), lambda h, e: module.project(h, e)), [h, emb], accelerator,
                   list(module.parameters()))


def mtp_projection(args: ModelArgs, depth: int, micro_batch: int, seq: int, act: float,
                   accelerator: bool) -> Measured:
    """An MTP module's input projection (``MTPModule.project``: ``eh_proj(cat[enorm(emb), hnorm(h)])``) on
    ``seq`` positions; its embedding and hidden-state inputs are counted when it keeps them."""
    layer_id = args.n_layers + depth
    # only the norm recompute reaches it (eh_proj is a BF16 GEMM even under FP8)
    largs = args.replace(recompute=("norm",) if args.recomputes("norm", layer_id) else (), recompute_layers=None,
                         fp8=False, fp8_cache_activations=None)
    return _projection(largs, depth, micro_batch, seq, act, accelerator)


def mtp(args: ModelArgs, depth: int, micro_batch: int, seq: int, act: float, accelerator: bool) -> Measured:
    """One MTP module (``MTPModule.forward`` = its block on its input projection) on ``seq`` positions."""
    return mtp_projection(args, depth, micro_batch, seq, act, accelerator).then(
        block(args, args.n_layers + depth, micro_batch, seq, act, accelerator))


@_cached
def _head(args: ModelArgs, recompute_norm: bool, micro_batch: int, seq: int, act: float,
          accelerator: bool) -> Measured:
    from models.deepseek_v3.layers import RMSNorm

    dtype = _dtype(act)
    norm = _build(lambda: RMSNorm(args.dim, args.norm_eps, args.fused_ops), dtype)
    head = _build(lambda: torch.nn.Linear(args.dim, args.vocab_size, bias=False), dtype)
    targets = torch.zeros(micro_batch, seq, dtype=torch.long)
    policy = MemoryPolicy(torch.nn.ModuleDict({"norm": norm}),
                          args.replace(recompute=("norm",) if recompute_norm else ()))
    return measure(_under(policy, lambda h, t: head_loss(norm, head, h, t)), [_hidden(args, micro_batch, seq, dtype),
                   targets], accelerator, [*norm.parameters(), *head.parameters()])


def head(args: ModelArgs, recompute_norm: bool, micro_batch: int, seq: int, act: float,
         accelerator: bool) -> Measured:
    """One loss head (``model.head_loss``: final norm, output head, cross-entropy) on ``seq`` positions."""
    # the head sees only the sizes (its norm's recompute is passed): layouts that differ otherwise share it
    largs = args.replace(recompute=(), recompute_layers=None, fp8=False, fp8_cache_activations=None)
    return _head(largs, recompute_norm, micro_batch, seq, act, accelerator)


@_cached
def _moe_parts(args: ModelArgs, micro_batch: int, seq: int, act: float, accelerator: bool) -> tuple[Measured, Measured]:
    dtype = _dtype(act)
    block = _build(lambda: Block(args, args.n_dense_layers), dtype)
    moe, tokens = block.ffn, micro_batch * seq
    x = torch.empty(tokens, args.dim, device=META, dtype=dtype, requires_grad=True)
    params = list(block.parameters())
    router = measure(lambda x: (moe.route(x, seq).weights,), [x], accelerator, params, own_inputs=False)
    shared = measure(_under(MemoryPolicy(block, args), lambda x: moe.shared(x)), [x], accelerator, params,
                     own_inputs=False) if args.n_shared_experts else Measured(0, 0)
    return router, shared


def pieces(args: ModelArgs, micro_batch: int, seq: int, act: float, accelerator: bool,
           slots: int | None = None) -> dict[str, Measured]:
    """Each kind of piece of the model measured at one micro-batch: ``attention`` (``Block.attention``),
    the MoE's ``router`` (``MoE.route``), ``routed experts`` (``Experts.forward``, ``slots`` of them: one EP
    rank's), ``shared experts`` (``MoE.shared``), ``dense FFN``, the MoE's ``norm/permute/combine`` (the rest
    of a MoE layer), ``MTP input projection`` (an MTP module less its block) and ``loss head``
    (``model.head_loss``). Router and shared experts are measured on their input (the norm's output, counted
    with the rest); the rest and the dense FFN are differences of whole blocks
    (``saved`` only, ``transient`` 0: a difference of peaks means nothing)."""
    out: dict[str, Measured] = {}
    tokens, e = micro_batch * seq, args.n_routed_experts
    slots = e if slots is None else slots
    if args.n_dense_layers:
        dense = block(args, 0, micro_batch, seq, act, accelerator)
        attn = attention(args, 0, micro_batch, seq, act, accelerator)
        out["attention (dense layer)"] = attn
        out["dense FFN"] = Measured(dense.saved - attn.saved, 0)
    moe_id = args.n_dense_layers
    if args.has_moe:
        whole = block(args, moe_id, micro_batch, seq, act, accelerator)
        attn = attention(args, moe_id, micro_batch, seq, act, accelerator)
        largs, _ = _layer_args(args, moe_id)
        router, shared = _moe_parts(largs, micro_batch, seq, act, accelerator)
        routed = experts(args, moe_id, tokens, e, act, accelerator)
        out["attention (MoE layer)"] = attn
        out["router"] = router
        out["routed experts"] = experts(args, moe_id, tokens, slots, act, accelerator)
        out["shared experts"] = shared
        out["norm/permute/combine"] = Measured(whole.saved - attn.saved - router.saved - routed.saved
                                                 - shared.saved, 0)
    for depth in range(args.n_mtp_layers):
        out[f"MTP {depth + 1} input projection"] = mtp_projection(args, depth, micro_batch, seq, act, accelerator)
    out["loss head"] = head(args, "norm" in args.recompute_kinds, micro_batch, seq, act, accelerator)
    return out


# ---- DeepSeek-V4's pieces ----------------------------------------------------------------------------

def v4_expert_args(args: V4Args) -> ModelArgs:
    """V3 arguments whose routed experts are V4's (width, count, top-k, FP8 and weight format): V4's experts share
    V3's grouped layout (``w13`` / ``w2``), and training runs them through V3's ``Experts`` (grouped GEMMs over
    one EP rank's slots, rows padded per expert)."""
    return ModelArgs(dim=args.dim, moe_inter_dim=args.moe_inter_dim, n_layers=1, n_dense_layers=0,
                     n_routed_experts=args.n_routed_experts, n_activated_experts=args.n_activated_experts,
                     n_expert_groups=1, n_limited_groups=1, n_shared_experts=args.n_shared_experts,
                     fp8=args.fp8, expert_weight_format=args.expert_weight_format, n_mtp_layers=0)


def _v4_angles(args: V4Args, seq: int) -> dict[bool, torch.Tensor]:
    pos = torch.arange(seq)
    return {c: rope_angles(args, pos, c).to(META) for c in (False, True)}


def _v4_streams(args: V4Args, micro_batch: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(micro_batch, seq, args.hc_mult, args.dim, device=META, dtype=dtype, requires_grad=True)


@_cached
def _v4_block(args: V4Args, layer_id: int, micro_batch: int, seq: int, act: float, accelerator: bool,
              recompute: bool) -> Measured:
    dtype = _dtype(act)
    mtp = layer_id >= args.n_layers
    block = _build(lambda: (V4MTPBlock if mtp else V4Block)(args, layer_id), dtype)
    angles, tokens = _v4_angles(args, seq), torch.zeros(micro_batch, seq, dtype=torch.long)
    inputs = [_v4_streams(args, micro_batch, seq, dtype), tokens]
    if mtp:  # the streams, the next tokens' embeddings (an input like the streams), the tokens
        fn = lambda h, t, e: block(h, e, angles, t)  # noqa: E731
        inputs.append(_hidden(args, micro_batch, seq, dtype))
    else:
        fn = lambda h, t: block(h, angles, t)  # noqa: E731
    if recompute:  # whole-block recompute: torch's checkpoint keeps the inputs, re-runs the block in backward
        run = fn
        fn = lambda *xs: checkpoint(run, *xs, use_reentrant=False)  # noqa: E731
    return measure(fn, inputs, accelerator, list(block.parameters()))


@_cached
def _v4_gate(args: V4Args, tokens: int, act: float, accelerator: bool) -> Measured:
    dtype = _dtype(act)
    gate = _build(lambda: V4Gate(args, args.n_hash_layers), dtype)
    x = torch.empty(tokens, args.dim, device=META, dtype=dtype, requires_grad=True)
    ids = torch.zeros(tokens, dtype=torch.long)
    return measure(lambda x, i: gate(x, i)[0], [x, ids], accelerator, list(gate.parameters()), own_inputs=False)


def v4_block(args: V4Args, layer_id: int, micro_batch: int, seq: int, act: float, accelerator: bool,
             slots: int) -> Measured:
    """One V4 ``Block`` (``MTPBlock`` for ``layer_id >= n_layers``: its input projections too) on ``micro_batch x
    seq`` tokens, from its ``hc_mult`` input streams (which it keeps: they are counted here), with its routed
    experts measured as one EP rank's ``slots`` of the grouped ``Experts`` (V3's, which V4's MoE runs; the
    router's ``v4_expert_args``). Layers alike in what memory sees
    (compress ratio, MTP or not, block recompute) share one measurement: a hash-routed layer measures as a scored
    one (the table lookup replaces the top-k, the same tensors stay)."""
    ratio, mtp = args.compress_ratios[layer_id], layer_id >= args.n_layers
    recompute = args.recomputes("block", layer_id)
    # a representative layer of the same kind, every per-layer switch normalised (one cache entry per kind), with
    # only top-k routed experts on one rank (balanced routing gives each the same rows): its router and experts are
    # then swapped for full-size ones, one EP rank's slots, measured alone; the indexer's q . k format only where
    # the kind has an indexer (compress ratio 4)
    small = args.replace(n_hash_layers=0, recompute=(), recompute_layers=None, n_mtp_layers=1, fp8=False,
                         expert_weight_format="bf16", compress_ratios=(ratio,) * (args.n_layers + 1),
                         n_routed_experts=args.n_activated_experts,
                         indexer_qk_format=args.indexer_qk_format if ratio == 4 else "bf16")
    m = _v4_block(small, small.n_layers if mtp else 0, micro_batch, seq, act, accelerator, recompute)
    tokens = micro_batch * seq
    parts = [(experts(v4_expert_args(small), 0, tokens, small.n_routed_experts, act, accelerator),
              experts(v4_expert_args(args), 0, tokens, slots, act, accelerator)),
             (_v4_gate(small, tokens, act, accelerator),
              _v4_gate(small.replace(n_routed_experts=args.n_routed_experts), tokens, act, accelerator))]
    for out, into in parts:
        if recompute:  # a recomputed block keeps only its input: the rest is transient
            out, into = Measured(0, out.saved + out.transient), Measured(0, into.saved + into.transient)
        m = m.swap(out, into)
    return m


@_cached
def _v4_head(args: V4Args, micro_batch: int, seq: int, act: float, accelerator: bool) -> Measured:
    dtype = _dtype(act)
    hc_head = _build(lambda: V4HCHead(args), dtype)
    norm = _build(lambda: V4RMSNorm(args.dim, args.norm_eps), dtype)
    head = _build(lambda: torch.nn.Linear(args.dim, args.vocab_size, bias=False), dtype)
    targets = torch.zeros(micro_batch, seq, dtype=torch.long)
    return measure(lambda h, t: head_loss(norm, head, hc_head(h), t), [_v4_streams(args, micro_batch, seq, dtype),
                   targets], accelerator, [*hc_head.parameters(), *norm.parameters(), *head.parameters()])


def v4_head(args: V4Args, micro_batch: int, seq: int, act: float, accelerator: bool) -> Measured:
    """One V4 loss head on ``seq`` positions: ``hc_head`` collapsing the streams, the final norm, the output head
    and cross-entropy (``model.head_loss``: the logits made a chunk of rows at a time)."""
    largs = args.replace(recompute=(), recompute_layers=None, fp8=False)  # the head sees only the sizes
    return _v4_head(largs, micro_batch, seq, act, accelerator)


def cache_clear() -> None:
    """Forget every measurement (after the model's code changed within one process: tests)."""
    for fn in (_block, _experts, _projection, _head, _moe_parts, _v4_block, _v4_gate, _v4_head):
        fn.cache_clear()
