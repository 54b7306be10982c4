"""DeepSeek-V3's memory policy, applied to an unmodified model from outside: which activations autograd keeps.

V3 (report 3.2.3, 3.3.3) keeps neither an RMSNorm's output nor the SwiGLU's for backward: the GEMM after each
would save them as its input, so they are remade from what is kept anyway (the norm's input, the SwiGLU's
input) just before that GEMM's backward reads them; under FP8 activation caching the SwiGLU input itself is
kept as e4m3 + 1x128 scales. ``MemoryPolicy`` does that with ``torch.autograd.graph.saved_tensors_hooks``, the
PyTorch mechanism for choosing how saved tensors are stored: forward hooks on the chosen modules (RMSNorm,
SwiGLU, the MTP input projection's concatenation) note each output and how to remake it; when autograd then
saves that output (or a view of it) inside ``policy.applied()``, the hook keeps the recipe instead, and the
unpack (in backward) remakes the value without a graph. Nothing on the model changes: its forward is the math,
its gradients are those of no policy bit for bit (the remake runs the same module on the same input).

Which modules: the kinds of ``ModelArgs.recompute`` (``norm``: every RMSNorm whose output feeds a GEMM, the
final and MTP head norms and MTP's enorm/hnorm included; ``mla_up``: what reaches MLA's attention core, the
per-head q, k, v or the absorbed queries and latent rows, remade by the MLA's own ``up_project`` / ``absorb`` from
the latents it keeps anyway, and the q/kv norms' outputs its GEMMs read; ``swiglu``), per layer
(``recompute_layers``), and ``fp8_cache`` (the SwiGLU recomputed, its input kept in FP8). ``block`` (whole-block
recompute) is ``recomputed``: the wrapper that whoever runs a layer (the layer loop, the MTP depths, the
overlapped plan's pieces) takes, ``torch.utils.checkpoint`` around the layer (``training.recompute``); inside it
the checkpoint's own hooks decide (it keeps only the layer's input).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

import deep_gemm
from deep_gemm.reference import dequantize
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.block import Block
from models.deepseek_v3.layers import RMSNorm, SwiGLU
from models.deepseek_v3.mla import MLA
from models.deepseek_v3.mtp import MTPModule
from training.recompute import checkpointed


class _Fp8:
    """A saved tensor kept as its 1x128 e4m3 cast (values, scales): FP8 activation caching."""

    __slots__ = ("q", "scales", "dtype", "shape")

    def __init__(self, x: torch.Tensor):
        self.q, self.scales = deep_gemm.per_token_cast_to_fp8(x.detach().reshape(-1, x.shape[-1]))
        self.dtype, self.shape = x.dtype, x.shape

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.scales

    def value(self) -> torch.Tensor:
        return dequantize(self.q, self.scales).to(self.dtype).view(self.shape)


class _Recipe:
    """``fn(*inputs)`` remade without a graph, once; ``inputs`` are what the policy keeps of the producer's inputs
    (tensors, ``_Fp8`` casts or other recipes)."""

    __slots__ = ("fn", "inputs", "made", "__weakref__")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple):
        self.fn, self.inputs, self.made = fn, inputs, None

    def tensors(self) -> Iterator[torch.Tensor]:
        for x in self.inputs:
            yield from _kept_tensors(x)

    def value(self) -> torch.Tensor:
        if self.made is None:
            with torch.no_grad():
                self.made = self.fn(*(_value(x) for x in self.inputs))
        return self.made


class _Part:
    """Output ``index`` of a recipe that makes several (the MLA up-projection's q, k, v)."""

    __slots__ = ("of", "index", "__weakref__")

    def __init__(self, of: _Recipe, index: int):
        self.of, self.index = of, index

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.of.tensors()

    def value(self) -> torch.Tensor:
        return self.of.value()[self.index]


class _View:
    """A saved view (``size``, ``stride``, ``offset``) of the storage a remade tensor lives in."""

    __slots__ = ("of", "size", "stride", "offset")

    def __init__(self, of: _Recipe | _Part | _Fp8, t: torch.Tensor):
        self.of, self.size, self.stride, self.offset = of, t.size(), t.stride(), t.storage_offset()

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from _kept_tensors(self.of)

    def value(self) -> torch.Tensor:
        made = self.of.value()
        # a recipe remakes the whole storage the view lived in; an FP8 cast (of a tensor that was all of its storage)
        # dequantises into a tensor of its own, which may itself be a slice of a padded buffer
        base = _root(made) if isinstance(self.of, (_Recipe, _Part)) else _alone(made)
        return base.as_strided(self.size, self.stride, self.offset)


def _value(x):
    return x.value() if isinstance(x, (_Recipe, _Part, _Fp8, _View)) else x


def _kept_tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (_Recipe, _Part, _Fp8, _View)):
        yield from x.tensors()


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that is all of its storage (a copy where it is not)."""
    return t if t._base is None and t.storage_offset() == 0 and t.is_contiguous() else t.clone(
        memory_format=torch.contiguous_format)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage, contiguous from its start (its views are then views of its cast)."""
    root = _root(t)
    return (t.is_contiguous() and root.is_contiguous() and t.numel() == root.numel()
            and t.storage_offset() == 0 == root.storage_offset())


class MemoryPolicy:
    """V3's recompute kinds and FP8 caching for ``model`` (a ``Transformer``, or any module holding its blocks, MTP
    modules and final norm), per ``args``. Forwards whose activations it governs run inside ``applied()``."""

    def __init__(self, model: nn.Module, args: ModelArgs, layer_id: int | None = None):
        """``layer_id``: the layer of SwiGLUs outside any ``Block`` of ``model`` (a lone ``Experts`` or ``MLP``)."""
        self._args = args
        self._made: dict[int, tuple[weakref.ref, _Recipe | _Part | _Fp8]] = {}  # id(tensor) -> (it, how to keep it)
        self._bases: dict[int, tuple[weakref.ref, _Recipe | _Part]] = {}  # the same for the base of a remade view
        self._last: dict[nn.Module, _Recipe] = {}  # each MTP norm's last output recipe (its eh_proj input's parts)
        self._mtp_norms: set[nn.Module] = set()
        self._handles: list = []
        self._observe: Callable[[torch.Tensor], None] | None = None
        layer_of = {}
        for module in model.modules():
            if isinstance(module, Block):
                layer_of.update({id(m): module.layer_id for m in module.modules()})
                norms = []
                if args.recomputes("norm", module.layer_id):
                    norms += [module.attn_norm, module.ffn_norm]
                if args.recomputes("norm", module.layer_id) or args.recomputes("mla_up", module.layer_id):
                    norms += [getattr(module.attn, "q_norm", None), module.attn.kv_norm]
                for norm in filter(None, norms):
                    self._add_norm(norm)
                if args.recomputes("mla_up", module.layer_id) and not args.recomputes("block", module.layer_id):
                    self._add_mla_up(module.attn)
            elif isinstance(module, MTPModule) and args.recomputes("norm", module.layer_id):
                self._add_mtp_input(module)
                self._add_norm(module.norm)
        for act in model.modules():
            layer = layer_of.get(id(act), layer_id)
            if (isinstance(act, SwiGLU) and layer is not None and not args.recomputes("block", layer)
                    and (args.recomputes("swiglu", layer) or args.fp8_cache)):
                self._add_swiglu(act, fp8=args.fp8_cache)
        if "norm" in args.recompute_kinds and isinstance(getattr(model, "norm", None), RMSNorm):
            self._add_norm(model.norm)

    # ---- what is noted in the forward ---------------------------------------------------------------
    def _add_norm(self, norm: RMSNorm) -> None:
        """Keep ``norm``'s input instead of its output wherever the output is saved."""
        self._handles.append(norm.register_forward_hook(lambda m, args, out: self._note(out, m, args)))

    def _add_swiglu(self, act: SwiGLU, fp8: bool) -> None:
        """Keep the SwiGLU's input (``fp8``: as its 1x128 e4m3 cast) instead of its output."""
        def before(m: nn.Module, args: tuple) -> None:
            if fp8 and torch.is_grad_enabled() and args[0].requires_grad:
                self._remember(args[0], _Fp8(args[0]))

        self._handles.append(act.register_forward_pre_hook(before))
        self._handles.append(act.register_forward_hook(lambda m, args, out: self._note(out, m, args)))

    def _add_mla_up(self, mla: MLA) -> None:
        """Keep MLA's latents (the query latent before ``q_norm``, ``wkv_a``'s output) instead of what its forward
        makes of them for the attention core: remade by ``mla.up_project`` / ``mla.absorb``, as V3 recomputes the
        up-projections."""
        call: dict[str, torch.Tensor] = {}  # the forward in flight: its latents and RoPE tables

        def start(m: nn.Module, args: tuple, kwargs: dict) -> None:
            call.clear()
            if torch.is_grad_enabled():
                x, cos, sin = (args[i] if i < len(args) else kwargs[name] for i, name in enumerate(("x", "cos", "sin")))
                call.update(q_latent=x, cos=cos, sin=sin)  # without q LoRA the query latent is x itself

        def latent(name: str) -> Callable:
            def note(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
                if call:
                    call[name] = out
            return note

        def core(make: Callable, m: nn.Module, args: tuple) -> None:
            if not (call and "kv" in call and torch.is_grad_enabled()):
                return
            cos, sin = call["cos"], call["sin"]
            if "gathered" in call:  # context parallelism: the keys are the whole sequence's, gathered (kept as landed)
                c_kv, k_pe = call["gathered"]
                recipe = _Recipe(lambda q_latent, c, k: make(q_latent, c, k, cos, sin),
                                 (self._form(call["q_latent"]), c_kv, k_pe))
            else:
                recipe = _Recipe(lambda q_latent, kv: make(q_latent, *mla.kv_parts(kv, cos, sin), cos, sin),
                                 (self._form(call["q_latent"]), self._form(call["kv"])))
            for i, t in enumerate(args):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self._remember(t, _Part(recipe, i))

        self._handles += [mla.register_forward_pre_hook(start, with_kwargs=True),
                          mla.register_forward_hook(lambda m, args, out: call.clear()),
                          mla.wkv_a.register_forward_hook(latent("kv")),
                          mla.gathered_latent.register_forward_hook(latent("gathered")),
                          mla.inner_attention.register_forward_pre_hook(functools.partial(core, mla.up_project))]
        if mla.q_lora_rank:
            self._handles.append(mla.wq_a.register_forward_hook(latent("q_latent")))
        if mla.sparse_attention is not None:
            self._handles.append(mla.sparse_attention.register_forward_pre_hook(functools.partial(core, mla.absorb)))

    def _add_mtp_input(self, module: MTPModule) -> None:
        """MTP's ``eh_proj`` saves ``cat[enorm(emb), hnorm(h)]``: remade from the two norms' recipes."""
        for norm in (module.enorm, module.hnorm):
            self._add_norm(norm)

        def before(m: nn.Module, args: tuple) -> None:
            parts = (self._last.pop(module.enorm, None), self._last.pop(module.hnorm, None))
            if None not in parts and torch.is_grad_enabled() and args[0].requires_grad:
                self._remember(args[0], _Recipe(lambda a, b: torch.cat([a, b], dim=-1), parts))

        self._handles.append(module.eh_proj.register_forward_pre_hook(before))
        self._mtp_norms |= {module.enorm, module.hnorm}

    def _note(self, out: torch.Tensor, fn: Callable[..., torch.Tensor], inputs: tuple) -> None:
        if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
            return
        recipe = _Recipe(fn, tuple(self._form(x) if isinstance(x, torch.Tensor) else x for x in inputs))
        if fn in self._mtp_norms:
            self._last[fn] = recipe
        self._remember(out, recipe)

    def _remember(self, t: torch.Tensor, how: _Recipe | _Part | _Fp8) -> None:
        """``t`` is kept as ``how``; a view of the storage a remade ``t`` lives in is kept as a view of it. An FP8
        cast covers views of ``t`` only where ``t`` is all of its storage (a kernel op's wrapper hands the op
        ``t.reshape(rows, dim)``, which autograd then saves)."""
        for x, table in ((t, self._made), (_root(t), self._bases)):
            key = id(x)
            table[key] = (weakref.ref(x, lambda _, key=key, table=table: table.pop(key, None)), how)
            if isinstance(how, _Fp8) and not _whole(t):  # else an FP8 cast is of that tensor only
                break

    def _form(self, t: torch.Tensor):
        """How ``t`` is kept: its recipe or FP8 cast where one was noted (a view of either), else ``t`` itself."""
        entry = self._made.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        root = _root(t)
        entry = self._bases.get(id(root))
        if entry is None or entry[0]() is not root or t.dtype != root.dtype:
            return t
        return _View(entry[1], t)

    # ---- the hooks ----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        kept = self._form(t)
        if self._observe is not None:
            for x in _kept_tensors(kept):
                self._observe(x)
        return kept

    @contextmanager
    def applied(self, observe: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
        """Forwards inside this keep what the policy says; ``observe`` sees every tensor kept (measurement)."""
        previous, self._observe = self._observe, observe
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _value):
                yield
        finally:
            self._observe = previous

    def recomputed(self, layer: nn.Module, fn: Callable) -> Callable:
        """``fn``, a compute of ``layer`` (a ``Block``: its forward, or one of its plan pieces), as this policy runs
        it: recomputed whole in backward where the layer recomputes "block" (``training.recompute.checkpointed``),
        else ``fn`` itself. What the layer loop, the MTP depths and the plan's pieces take as ``wrap``
        (``models.deepseek_v3.block.LayerWrap``)."""
        if not self._args.recomputes("block", layer.layer_id):
            return fn
        return functools.partial(checkpointed, fn, layer)

    def remove(self) -> None:
        """Take the policy's hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
