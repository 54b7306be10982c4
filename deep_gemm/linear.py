"""FP8 training layers: ``linear`` / ``Fp8Linear`` and ``grouped_linear`` / ``GroupedLinear``.

With ``fp8=True`` all three GEMMs of a linear layer run in FP8 as in the DeepSeek-V3 report:
  forward  Y  = X @ W^T    X per 1x128 tile (per token),     W per 128x128 block   (``fp8_gemm_nt``)
  dgrad    dX = dY @ W     dY per 1x128 tile (per token),    W's forward blocks    (``fp8_gemm_nn``)
  wgrad    dW = dY^T @ X   dY and X per 1x128 tile along the token dimension      (``fp8_gemm_tn``)
``fp8="mxfp8"`` selects the second recipe, MXFP8 (OCP microscaling, as Megatron-Core and torchtitan train
V3 on Blackwell): every operand of all three GEMMs in 1x32 blocks along that GEMM's reduction dimension with
power-of-two (UE8M0) scales, so the weight is cast per row for the forward (1x32 along K) and per column
for the dgrad (32x1 along N), and the wgrad's operands 32x1 along the tokens. ``fp8=True`` is "blockwise".
Weight gradients are in the weight's dtype (fp32 or bf16), or fp32 for a bf16 weight with a
``main_grad``. Dimensions that are not multiples of 128 are zero-padded internally. On a CPU the
ops run their references (quantize, then exact fp32 arithmetic), so FP8 training can be studied
without a GPU.

Memory (DeepSeek-V3 report, 3.3.3): with ``fp8_cache`` the input is kept for backward only as the
forward's e4m3 + 1x128-scale cast (dequantized and re-tiled to 128x1 for the wgrad), not in its
own precision. Without it the wgrad makes that same cast from the kept input, so the numbers do not
depend on the memory option (or on recompute, which refills the input instead of caching it). The FP8
weights are never saved: backward casts the weight again (a weight-sized read) instead of holding a
copy per in-flight micro-batch.

Zero-bubble: backward computes the input gradient at once and hands the weight gradient to
``accel.wgrad.defer`` as a closure that accumulates into the weight's gradient exactly as autograd
would (``accel.grads.accumulate_grad``: ``.grad``, or the fp32 ``main_grad`` of a bf16 weight; runs at
once when nothing collects). The weight's gradient therefore never flows through autograd:
``torch.autograd.grad(..., weight)`` sees None; read ``accel.grads.grad(weight)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.node import has_side_effect

import accel.wgrad
from accel import registry
from accel.grads import accumulate_grad
from deep_gemm.cast import per_block_cast_to_fp8, per_channel_cast_to_fp8, per_token_cast_to_fp8
from deep_gemm.fp8_fp4 import m_grouped_fp8_fp4_gemm_nt_contiguous
from deep_gemm.gemm import fp8_gemm_nn, fp8_gemm_nt, fp8_gemm_tn
from deep_gemm.grouped import (
    check_m_indices,
    k_grouped_fp8_gemm_tn_contiguous,
    m_grouped_fp8_gemm_nn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
)
from deep_gemm.health import Fp8Health
from deep_gemm.mxfp4 import mxfp4_fake_quant, pack_mxfp4
from deep_gemm.reference import dequantize
from deep_gemm.utils import BLOCK, FP8, M_ALIGNMENT, MX_BLOCK, align

FP8_RECIPES = ("blockwise", "mxfp8")  # DeepSeek-V3's 1x128 / 128x128 with fp32 scales; MXFP8's 1x32 with UE8M0


def fp8_recipe(fp8: object) -> str | None:
    """The FP8 recipe an ``fp8`` argument selects: None (off), "blockwise" (True) or "mxfp8"."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return "blockwise"
    if fp8 in FP8_RECIPES:
        return fp8
    raise ValueError(f"fp8 must be False, True (= 'blockwise') or one of {FP8_RECIPES}, got {fp8!r}")


def _pad(x: torch.Tensor, *multiples: int) -> torch.Tensor:
    """Zero-pad the last ``len(multiples)`` dims of ``x`` up to those multiples (no copy when aligned)."""
    pads = []
    for size, mult in zip(reversed(x.shape[-len(multiples):]), reversed(multiples)):
        pads += [0, align(size, mult) - size]
    return F.pad(x, pads) if any(pads) else x


def _gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _act_cast(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation (or output gradient) as the left operand along its last dim: 1x128 fp32 scales, or MXFP8's
    1x32 UE8M0 ones (K padded to 128, the GEMMs' K granularity)."""
    mx = recipe == "mxfp8"
    return per_token_cast_to_fp8(_pad(x, BLOCK), use_ue8m0=mx, gran_k=MX_BLOCK if mx else BLOCK)


def takes_precast(fp8: object) -> bool:
    """Whether a layer with this ``fp8`` argument uses ``x_fp8``, a precast 1x128 e4m3 cast with fp32 scales of
    its input (the blockwise recipe). MXFP8 casts its activations 1x32 with UE8M0 scales; without FP8 nothing is
    cast: there ``linear`` / ``grouped_linear`` leave an offered ``x_fp8`` unread."""
    return fp8_recipe(fp8) == "blockwise"


def reads_only_precast(fp8: object, fp8_cache: bool, health: Fp8Health | None = None) -> bool:
    """Whether a GEMM with these arguments, given ``x_fp8``, reads nothing of ``x`` but that cast, forward and
    backward: the recipe uses a precast, ``fp8_cache`` keeps it for the wgrad (the dgrad needs no input), and no
    ``Fp8Health`` report is being sampled (it compares the cast with ``x``). A producer may then hand over ``x`` as a
    stand-in without storage (the fused FP8 permute)."""
    return takes_precast(fp8) and bool(fp8_cache) and (health is None or not health.active)


def out_is_view(fp8: object, out_features: int) -> bool:
    """Whether ``linear``'s output may be a view (of the FP8 GEMM's output padded to N = 128n; the op's never is, the
    health-monitored path's is): not to modify in place."""
    return fp8_recipe(fp8) is not None and out_features % BLOCK != 0


def _precast(x_fp8: object, x: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_fp8`` checked against ``x [rows, k]`` and as ``_act_cast`` makes it: values zero-padded to K = 128n (the
    cast of zero-padded ``x`` is the padded cast of ``x``: zeros move no amax and cast to 0)."""
    blocks = -(-k // BLOCK)
    if not (isinstance(x_fp8, (tuple, list)) and len(x_fp8) == 2 and all(isinstance(t, torch.Tensor) for t in x_fp8)):
        raise ValueError("x_fp8 must be (values e4m3 [rows, K], scales fp32 [rows, ceil(K/128)]), got "
                         f"{type(x_fp8).__name__}")
    values, scales = x_fp8
    if (values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or values.shape[-1:] != (k,)
            or values.numel() != rows * k or scales.shape[-1:] != (blocks,) or scales.numel() != rows * blocks):
        raise ValueError(f"x_fp8 must be (e4m3 [{rows}, {k}], fp32 [{rows}, {blocks}]) for x's {rows} rows of K = {k}, "
                         f"got ({values.dtype} {list(values.shape)}, {scales.dtype} {list(scales.shape)})")
    if values.device != x.device or scales.device != x.device:
        raise ValueError(f"x_fp8 must be on x's device {x.device}, got {values.device} and {scales.device}")
    values, scales = values.reshape(rows, k), scales.reshape(rows, blocks).contiguous()
    if k % BLOCK:
        values = _pad(values.view(torch.uint8), BLOCK).view(values.dtype)
    return values.contiguous(), scales


def _wgrad_cast(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A wgrad operand ``[tokens, features]``, scaled along the tokens (its reduction dim): 128x1 or 32x1."""
    mx = recipe == "mxfp8"
    return per_channel_cast_to_fp8(x, use_ue8m0=mx, gran_k=MX_BLOCK if mx else BLOCK)


def _forward_cast(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x`` as the forward's e4m3 cast, dequantized (K padded to 128): what the wgrad reads whether the cast
    was kept (``fp8_cache``) or ``x`` itself was (no caching, or recompute refilled it), so caching and
    recompute change memory, never the weight gradient."""
    return dequantize(*_act_cast(x, recipe))


def _run_or_defer(closure) -> None:
    if not accel.wgrad.defer(closure):
        closure()


# ---------------------------------------------------------------- dense


def _fp8_weight(weight: torch.Tensor, recipe: str, dgrad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [(G,) N, K]`` in FP8: blockwise, 128x128 blocks serve both GEMMs; MXFP8, 1x32 along K for the
    forward, 32x1 along N (the dgrad's reduction dim) for the dgrad."""
    w = _pad(weight.detach(), BLOCK, BLOCK)
    if recipe == "blockwise":
        return per_block_cast_to_fp8(w)
    return per_channel_cast_to_fp8(w, True, MX_BLOCK) if dgrad else per_token_cast_to_fp8(w, True, MX_BLOCK)


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: str | None,
                    health: Fp8Health | None, x_q: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(out, x's e4m3 cast or None)`` of ``x [m, K] @ weight^T + bias``."""
    m, n = x.shape[0], weight.shape[0]
    if fp8:
        w_q = _fp8_weight(weight, fp8)
        x_q = _act_cast(x, fp8) if x_q is None else x_q
        if health is not None:
            health.observe(weight, "fwd", "w", weight, w_q)
            health.observe(weight, "fwd", "x", x, x_q)
        d = torch.empty(m, w_q[0].shape[0], dtype=_gemm_out_dtype(x.dtype), device=x.device)
        fp8_gemm_nt(x_q, w_q, d)
        out = (d if d.shape[1] == n else d[:, :n]).to(x.dtype)  # a view only where N was padded
    else:
        out = x @ weight.to(x.dtype).T
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out, x_q


def _linear_backward(grad_out: torch.Tensor, saved: Sequence[torch.Tensor], weight: torch.Tensor, fp8: str | None,
                     cached: bool, k: int, x_dtype: torch.dtype, health: Fp8Health | None, input_grad: bool,
                     weight_grad: bool, bias_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_bias)``; the weight gradient goes to ``accel.wgrad`` (deferred) or straight into
    ``accel.grads`` (``saved``: x, or its forward cast when ``cached``)."""
    m = grad_out.shape[0]
    grad_out = grad_out.contiguous()
    grad_x = grad_bias = None
    if input_grad:
        if fp8:
            w_q = _fp8_weight(weight, fp8, dgrad=True)
            d = torch.empty(m, w_q[0].shape[1], dtype=_gemm_out_dtype(grad_out.dtype), device=grad_out.device)
            dy_q = _act_cast(grad_out, fp8)
            if health is not None:
                health.observe(weight, "dgrad", "dy", grad_out, dy_q)
            fp8_gemm_nn(dy_q, w_q, d)
            grad_x = d[:, :k].to(x_dtype)
        else:
            grad_x = (grad_out @ weight.to(grad_out.dtype)).to(x_dtype)
    if weight_grad:

        def weight_grad_closure() -> None:
            if fp8:
                x = dequantize(*saved) if cached else _forward_cast(saved[0], fp8)  # the forward's cast
                dy_q = _wgrad_cast(_pad(grad_out, BLOCK, BLOCK), fp8)
                x_q = _wgrad_cast(_pad(x, BLOCK, BLOCK), fp8)
                if health is not None:
                    health.observe(weight, "wgrad", "dy", grad_out, dy_q)
                    health.observe(weight, "wgrad", "x", x, x_q)
                d = torch.empty(dy_q[0].shape[1], x_q[0].shape[1], dtype=torch.float32, device=x.device)
                fp8_gemm_tn(dy_q, x_q, d)
                g = d[: weight.shape[0], :k]
            else:
                g = grad_out.T @ saved[0].to(grad_out.dtype)
            accumulate_grad(weight, g)

        _run_or_defer(weight_grad_closure)
    if bias_grad:
        grad_bias = grad_out.sum(0)
    return grad_x, grad_bias


class _LinearFunction(torch.autograd.Function):
    """The health-monitored path: ``Fp8Health`` (a Python observer of every cast) cannot cross an op schema, so a
    call with an active health monitor runs the same math (``_linear_forward`` / ``_linear_backward``) here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: str | None,
                fp8_cache: bool, health: Fp8Health | None, x_q: tuple[torch.Tensor, torch.Tensor] | None):
        out, x_q = _linear_forward(x, weight, bias, fp8, health, x_q)
        # the FP8 weight is cast again in backward rather than saved: one copy per in-flight micro-batch
        # would cost a byte per parameter each
        ctx.save_for_backward(*(x_q if fp8 and fp8_cache else (x,)))
        # The weight itself, not a saved-tensor copy: its gradient is what the wgrad closure accumulates
        # into, which must be the real parameter even under non-reentrant checkpointing or offload hooks.
        ctx.weight, ctx.health = weight, health
        ctx.meta = (fp8, bool(fp8) and fp8_cache, bias is not None, x.shape[1], x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        fp8, cached, has_bias, k, x_dtype = ctx.meta
        grad_x, grad_bias = _linear_backward(grad_out, ctx.saved_tensors, ctx.weight, fp8, cached, k, x_dtype,
                                             ctx.health, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                             has_bias and ctx.needs_input_grad[2])
        return grad_x, None, grad_bias, None, None, None, None


# The op form (docs/custom_ops.md): ``dsv3::linear`` returns the output and, with ``fp8_cache``, the e4m3 values
# (as their bytes, uint8: an FP8 output would enter opcheck's and AOT's float bookkeeping, where float8 has no CPU
# kernels) and 1x128 (MXFP8: 1x32) scales of the cast it made, which its registered autograd keeps for the wgrad
# instead of x (issue 35's FP8 activation caching, in the GEMM op's autograd); a precast ``x_fp8`` is kept as given. Its
# backward is the opaque op ``dsv3::linear_backward``: the input gradient it returns, the weight gradient it hands
# to ``accel.wgrad`` / ``accel.grads`` as ``_LinearFunction`` does (never through autograd), so the deferred
# zero-bubble W pass and ``main_grad`` accumulation are unchanged, compiled or not.
@registry.library_op("dsv3::linear")
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: str | None, fp8_cache: bool,
               x_values: torch.Tensor | None, x_scales: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_values`` / ``x_scales``: the precast ``x_fp8`` (both or neither)."""
    out, x_q = _linear_forward(x, weight, bias, fp8, None, None if x_values is None else (x_values, x_scales))
    if fp8 and fp8_cache and x_values is None:
        return out.contiguous(), x_q[0].view(torch.uint8), x_q[1]
    return out.contiguous(), x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32)


@_linear_op.register_fake
def _(x, weight, bias, fp8, fp8_cache, x_values, x_scales):
    out = x.new_empty(x.shape[0], weight.shape[0])
    if fp8 and fp8_cache and x_values is None:
        k = align(x.shape[1], BLOCK)
        return out, x.new_empty(x.shape[0], k, dtype=torch.uint8), x.new_empty(
            x.shape[0], k // (MX_BLOCK if fp8 == "mxfp8" else BLOCK), dtype=torch.float32)
    return out, x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32)


@registry.library_op("dsv3::linear_backward")
def _linear_backward_op(grad_out: torch.Tensor, saved: list[torch.Tensor], weight: torch.Tensor, fp8: str | None,
                        cached: bool, k: int, x_dtype: torch.dtype, input_grad: bool, weight_grad: bool,
                        bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_bias = _linear_backward(grad_out, saved, weight, fp8, cached, k, x_dtype,
                                         None, input_grad, weight_grad, bias_grad)
    return (grad_out.new_empty(0) if grad_x is None else grad_x.contiguous(),
            grad_out.new_empty(0) if grad_bias is None else grad_bias)


@_linear_backward_op.register_fake
def _(grad_out, saved, weight, fp8, cached, k, x_dtype, input_grad, weight_grad, bias_grad):
    return (grad_out.new_empty(grad_out.shape[0], k, dtype=x_dtype) if input_grad else grad_out.new_empty(0),
            grad_out.new_empty(weight.shape[0]) if bias_grad else grad_out.new_empty(0))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias, fp8, fp8_cache, x_values, x_scales = inputs
    _, values, scales = output
    cached = bool(fp8) and fp8_cache
    if not cached:
        kept = (x,)
    else:  # the precast as given, or the op's own cast (handed over as bytes)
        kept = (x_values, x_scales) if x_values is not None else (values.view(FP8), scales)
    ctx.save_for_backward(*kept)
    ctx.weight = weight  # the parameter itself, as in _LinearFunction
    ctx.meta = (fp8, cached, bias is not None, x.shape[1], x.dtype)
    ctx.mark_non_differentiable(values, scales)


def _linear_autograd(ctx, grad_out: torch.Tensor, _dvalues, _dscales):
    fp8, cached, has_bias, k, x_dtype = ctx.meta
    input_grad, bias_grad = ctx.needs_input_grad[0], has_bias and ctx.needs_input_grad[2]
    grad_x, grad_bias = _linear_backward_op(grad_out, list(ctx.saved_tensors), ctx.weight, fp8, cached, k, x_dtype,
                                            input_grad, ctx.needs_input_grad[1], bias_grad)
    return (grad_x if input_grad else None), None, (grad_bias if bias_grad else None), None, None, None, None


_linear_op.register_autograd(_linear_autograd, setup_context=_linear_setup)
# The weight gradient is this op's side effect (accumulated outside autograd, above), so a compiled backward must
# keep the op where its returned input gradient goes unused (an input that needs no gradient, e.g. the V3.2
# indexer's detached ones): without this, dead-code elimination drops the call and the weight silently gets none.
has_side_effect(torch.ops.dsv3.linear_backward.default)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fp8: bool | str = False,
           fp8_cache: bool = False, health: Fp8Health | None = None,
           x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for ``x [..., K]`` and ``weight [N, K]``; FP8 GEMMs forward and backward with ``fp8``
    (True or "blockwise": DeepSeek-V3's recipe; "mxfp8": 1x32 blocks with UE8M0 scales).

    ``fp8_cache`` (with ``fp8``): keep ``x`` for the weight gradient only as the forward's e4m3 + 1x128
    cast (about 1/4 of fp32, 1/2 of bf16), not ``x`` itself; the wgrad re-tiles it to 128x1.
    The weight gradient is deferred through ``accel.wgrad`` (see the module docstring). ``health``: the run's
    ``deep_gemm.health.Fp8Health``, told about every FP8 cast of this call while it is active.

    The output is a tensor of its own, which the caller may modify in place, except with an active ``health``,
    ``fp8`` and N not a multiple of 128 (``out_is_view``, which callers check without knowing about health):
    then it is a view of the GEMM's padded output, and autograd forbids in-place changes to a view made inside
    an ``autograd.Function``.

    ``x_fp8``: ``(values e4m3 [rows, K], scales fp32 [rows, ceil(K/128)])``, the 1x128 cast of ``x`` that this
    call would make (``per_token_cast_to_fp8``, e.g. written by a fused norm): the forward GEMM reads it instead
    of casting ``x`` again, and ``fp8_cache`` keeps it for the wgrad; ``x`` stays the differentiable input (and,
    without caching, what the wgrad casts again). Read only where ``takes_precast(fp8)`` (the GEMM decides: other
    recipes cast ``x`` as they need, so a producer may offer its cast to any layer); the numbers are those of the
    call without it when it is that cast.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor [..., K], got {getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point [N, K] tensor, got {getattr(weight, 'shape', weight)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's K (weight is {list(weight.shape)})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
    recipe = fp8_recipe(fp8)
    lead, rows = x.shape[:-1], x.numel() // max(x.shape[-1], 1)
    x_q = None if x_fp8 is None or not takes_precast(fp8) else _precast(x_fp8, x, rows, x.shape[-1])
    health = health if health is not None and health.active else None
    x2 = x.reshape(-1, x.shape[-1])
    if health is not None:
        out = _LinearFunction.apply(x2, weight, bias, recipe, bool(fp8_cache), health, x_q)
    else:
        out = _linear_op(x2, weight, bias, recipe, bool(fp8_cache), *(x_q or (None, None)))[0]
    return out.reshape(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (``fp8=False`` gives the bf16/fp32 path); ``fp8_cache``
    keeps its input for backward only in FP8 (see ``linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 fp8: bool | str = True, fp8_cache: bool = False):
        fp8_recipe(fp8)  # a bad recipe fails here, not at the first forward
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8, self.fp8_cache = fp8, fp8_cache
        self.health: Fp8Health | None = None  # set by Fp8Health.attach

    def forward(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x_fp8``: ``x``'s 1x128 cast, made by its producer (see ``linear``)."""
        return linear(x, self.weight, self.bias, fp8=self.fp8, fp8_cache=self.fp8_cache, health=self.health,
                      x_fp8=x_fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8}, fp8_cache={self.fp8_cache}"


# ---------------------------------------------------------------- grouped (MoE experts)


def _block_owners(m_indices: torch.Tensor) -> list[int]:
    """Group of each 128-row block (-1 for all-padding blocks), on the host."""
    return m_indices.view(-1, M_ALIGNMENT).amax(dim=1).tolist()


def _k_grouped_rows(owners: list[int], num_groups: int, device) -> tuple[torch.Tensor | None, list[int]]:
    """Row order that puts blocks in ascending group order (None when already so), and rows per group."""
    ks = [0] * num_groups
    for g in owners:
        if g >= 0:
            ks[g] += M_ALIGNMENT
    if all(g >= 0 for g in owners) and owners == sorted(owners):
        return None, ks
    blocks = sorted((g, i) for i, g in enumerate(owners) if g >= 0)
    rows = torch.arange(M_ALIGNMENT, device=device)
    order = torch.cat([rows + i * M_ALIGNMENT for _, i in blocks]) if blocks else rows[:0]
    return order, ks


def _row_runs(m_indices: torch.Tensor) -> list[tuple[int, int]]:
    """(group, row count) of each run of rows with one group id, in row order, padding runs (-1) included.

    Row-exact (not per 128-row block): the unquantized path computes only valid rows, so it needs no
    masking multiplies and does no GEMM work on padding (on average half a block per group).
    """
    if m_indices.numel() == 0:
        return []
    starts = torch.cat([m_indices.new_zeros(1, dtype=torch.long),
                        torch.nonzero(m_indices[1:] != m_indices[:-1]).squeeze(1) + 1])
    ends = torch.cat([starts[1:], starts.new_full((1,), m_indices.numel())])
    return [(g, n) for g, n in torch.stack([m_indices[starts].long(), ends - starts], dim=1).tolist()]


# The two helpers below cut their operands with one ``split`` per tensor and ``unbind`` the groups
# (one call each, returning views) instead of slicing in Python per run (forward+backward of a
# host-bound 16-group call: 2.5 -> 2.1 ms). Outputs start from ``empty``: only padding rows and unused
# groups are zeroed, as zero-filling whole [M, N] buffers costs more than their padding.


@torch.no_grad()  # out= GEMMs; also runs from deferred wgrad closures, where grad mode may be on
def _segment_mm(a: torch.Tensor, b_t: torch.Tensor, runs: list[tuple[int, int]], out_cols: int) -> torch.Tensor:
    """``out[r] = a[r] @ b_t[group(r)]`` on valid rows, 0 on padding rows (``b_t`` is ``[G, K, N]``)."""
    out = registry.empty(a.shape[0], out_cols, dtype=a.dtype, device=a.device)  # NaN under poisoned_outputs
    sizes = [n for _, n in runs]
    weights = b_t.unbind(0)
    for (g, _), a_rows, out_rows in zip(runs, a.split(sizes), out.split(sizes)):
        if g >= 0:
            torch.mm(a_rows, weights[g], out=out_rows)
        else:
            out_rows.zero_()
    return out


@torch.no_grad()  # runs in a deferred closure, possibly with grad mode on and x requiring grad
def _grouped_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         runs: list[tuple[int, int]]) -> torch.Tensor:
    """Per-group ``dW[g] = sum over g's runs of dY^T X``, fp32. An fp32 GEMM writes its group's slice
    directly (no zero-filled accumulator, no extra add); lower precisions accumulate in fp32."""
    g_w = registry.empty(weight.shape, dtype=torch.float32, device=x.device)  # NaN under poisoned_outputs
    slices = g_w.unbind(0)
    written = [False] * weight.shape[0]
    sizes = [n for _, n in runs]
    x = x.to(grad_out.dtype)
    for (g, _), dy, xs in zip(runs, grad_out.split(sizes), x.split(sizes)):
        if g < 0:
            continue
        if grad_out.dtype != torch.float32:
            part = (dy.T @ xs).float()
            if written[g]:
                slices[g].add_(part)
            else:
                slices[g].copy_(part)
        elif not written[g]:
            torch.mm(dy.T, xs, out=slices[g])
        else:
            slices[g].addmm_(dy.T, xs)
        written[g] = True
    for g, done in enumerate(written):
        if not done:
            slices[g].zero_()
    return g_w


def _grouped_forward(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, host: torch.Tensor,
                     fp8: str | None, health: Fp8Health | None, x_q: tuple[torch.Tensor, torch.Tensor] | None,
                     mxfp4: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(out, x's e4m3 cast or None)``; ``host``: ``m_indices`` on the CPU (the group layout is read there, and
    checked there: inside the op, where torch.compile does not trace it). ``mxfp4``: QAT, the GEMM sees the
    weight's MXFP4 fake quantisation (``deep_gemm.mxfp4``)."""
    num_groups, n, k = weight.shape
    check_m_indices(host, x.shape[0], num_groups, rows_of="x")
    if mxfp4 and health is not None:
        health.observe_mxfp4(weight, "fwd", "w_mxfp4" if fp8 else "w", weight)
    if not fp8:
        w = mxfp4_fake_quant(weight) if mxfp4 else weight
        # only the valid rows are read or computed; padding rows of the output are 0 (never NaN)
        return _segment_mm(x, w.to(x.dtype).transpose(1, 2), _row_runs(host), n), None
    valid = (m_indices >= 0).unsqueeze(1)
    x_valid = x * valid.to(x.dtype) if x_q is None or health is not None else None  # padding rows give 0
    # a precast's padding rows are never read: the GEMM skips them, the cached wgrad operand zeroes them
    x_q = _act_cast(x_valid, fp8) if x_q is None else x_q
    if health is not None:
        health.observe(weight, "fwd", "x", x_valid, x_q)
    if mxfp4 and fp8 == "blockwise":
        # QAT under blockwise FP8: the 1x128 rows times the MXFP4 weight in its released layout, through the FP8 x
        # MXFP4 grouped GEMM (K zero-padded to 128: zeros move no block's amax, so the FP4 values are the fake
        # quantisation's)
        b = pack_mxfp4(_pad(weight.detach(), BLOCK))
        d = torch.zeros(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
        m_grouped_fp8_fp4_gemm_nt_contiguous(x_q, b, d, m_indices)
        return d.to(x.dtype), x_q
    # QAT under MXFP8: the MXFP4 weight's 1x32 E8M0 blocks are MXFP8's, so its FP8 cast keeps it exactly
    w_q = _fp8_weight(mxfp4_fake_quant(weight) if mxfp4 else weight, fp8)
    if health is not None:
        health.observe(weight, "fwd", "w", weight, w_q)
    d = torch.zeros(x.shape[0], w_q[0].shape[1], dtype=torch.bfloat16, device=x.device)
    m_grouped_fp8_gemm_nt_contiguous(x_q, w_q, d, m_indices)
    return d[:, :n].to(x.dtype), x_q


def _grouped_backward(grad_out: torch.Tensor, saved_x: Sequence[torch.Tensor], weight: torch.Tensor,
                      m_indices: torch.Tensor, host: torch.Tensor, fp8: str | None, cached: bool, x_dtype: torch.dtype,
                      health: Fp8Health | None, input_grad: bool, weight_grad: bool,
                      mxfp4: bool = False) -> torch.Tensor | None:
    """The input gradient; the weight gradient deferred through ``accel.wgrad`` (``saved_x``: x, or its forward
    cast when ``cached``; ``host``: ``m_indices`` on the CPU). ``mxfp4``: QAT, the input gradient through the
    forward's MXFP4 weight (cast again, not saved), the weight gradient straight through to the master weight."""
    num_groups, n, k = weight.shape
    rows = m_indices.shape[0]
    grad_x = None
    if not fp8:
        runs = _row_runs(host)
        x, grad_out = saved_x[0], grad_out.contiguous()
        if input_grad:
            w = mxfp4_fake_quant(weight) if mxfp4 else weight
            grad_x = _segment_mm(grad_out, w.to(grad_out.dtype), runs, x.shape[1]).to(x.dtype)
        if weight_grad:
            _run_or_defer(lambda: accumulate_grad(weight, _grouped_weight_grad(grad_out, x, weight, runs)))
        return grad_x
    valid = (m_indices >= 0).unsqueeze(1)
    grad_out = (grad_out * valid.to(grad_out.dtype)).contiguous()
    if input_grad and mxfp4 and fp8 == "blockwise":
        # the dgrad through the dequantised FP4 weight: its per-32-along-K scales vary along this GEMM's reduction
        # (N), which no FP8 weight cast holds exactly, so the 1x128 cast of dY meets the FP4 values in fp32
        dy_q = _act_cast(grad_out, fp8)
        if health is not None:
            health.observe(weight, "dgrad", "dy", grad_out, dy_q)
        dy = dequantize(*dy_q)[:, :n].contiguous()
        grad_x = _segment_mm(dy, mxfp4_fake_quant(weight.detach()).float(), _row_runs(host), k).to(x_dtype)
    elif input_grad:
        w_q = _fp8_weight(mxfp4_fake_quant(weight) if mxfp4 else weight, fp8, dgrad=True)
        d = torch.zeros(rows, w_q[0].shape[2], dtype=torch.bfloat16, device=grad_out.device)
        dy_q = _act_cast(grad_out, fp8)
        if health is not None:
            health.observe(weight, "dgrad", "dy", grad_out, dy_q)
        m_grouped_fp8_gemm_nn_contiguous(dy_q, w_q, d, m_indices)
        grad_x = d[:, :k].to(x_dtype)
        grad_x = grad_x * valid.to(grad_x.dtype)
    if weight_grad:
        owners = _block_owners(host)

        def weight_grad_closure() -> None:
            # the forward's 1x128 cast with its padding rows 0, kept (a precast's padding rows may hold anything)
            # or made again from x with its padding rows zeroed
            x = (torch.where(valid, dequantize(*saved_x), 0.0) if cached
                 else _forward_cast(saved_x[0] * valid.to(x_dtype), fp8))
            order, ks = _k_grouped_rows(owners, num_groups, x.device)
            dy, xs = (grad_out, x) if order is None else (grad_out[order], x[order])
            dy_q = _wgrad_cast(_pad(dy, BLOCK), fp8)
            x_q = _wgrad_cast(_pad(xs, BLOCK), fp8)
            if health is not None:
                health.observe(weight, "wgrad", "dy", dy, dy_q)
                health.observe(weight, "wgrad", "x", xs, x_q)
            d = torch.empty(num_groups, dy_q[0].shape[1], x_q[0].shape[1], dtype=torch.float32, device=x.device)
            ks_tensor = torch.tensor(ks, dtype=torch.int32, device=x.device)
            k_grouped_fp8_gemm_tn_contiguous(dy_q, x_q, d, ks, ks_tensor)
            accumulate_grad(weight, d[:, :n, :k])

        _run_or_defer(weight_grad_closure)
    return grad_x


def _host(m_indices: torch.Tensor) -> torch.Tensor:
    return m_indices.to("cpu", copy=True)


class _GroupedLinearFunction(torch.autograd.Function):
    """The health-monitored path (see ``_LinearFunction``), over the same helpers as the op."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, fp8: str | None,
                fp8_cache: bool, health: Fp8Health | None, x_q: tuple[torch.Tensor, torch.Tensor] | None,
                mxfp4: bool = False):
        host = _host(m_indices)
        out, x_q = _grouped_forward(x, weight, m_indices, host, fp8, health, x_q, mxfp4)
        # as in _LinearFunction: the FP8 weights are cast again in backward, not saved. Without caching x itself
        # is kept (masked again in backward), not a masked copy: under recompute it is the producer's output,
        # released and refilled, which a copy would not be.
        ctx.save_for_backward(*(x_q if fp8 and fp8_cache else (x,)), m_indices, host)
        ctx.weight, ctx.health = weight, health  # the parameter itself: see _LinearFunction
        ctx.meta = (fp8, bool(fp8) and fp8_cache, x.dtype, mxfp4)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        *saved_x, m_indices, host = ctx.saved_tensors
        fp8, cached, x_dtype, mxfp4 = ctx.meta
        grad_x = _grouped_backward(grad_out, saved_x, ctx.weight, m_indices, host, fp8, cached, x_dtype, ctx.health,
                                   ctx.needs_input_grad[0], ctx.needs_input_grad[1], mxfp4)
        return grad_x, None, None, None, None, None, None, None


EXPERT_WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4_qat")


# The op form, as dsv3::linear: both ops are opaque (the group layout is read on the host). The forward also
# returns m_indices copied to the CPU, which its autograd keeps, so the backward reads the layout again there
# without another device sync.
@registry.library_op("dsv3::grouped_linear")
def _grouped_linear_op(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, fp8: str | None,
                       fp8_cache: bool, x_values: torch.Tensor | None, x_scales: torch.Tensor | None,
                       mxfp4: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_values`` / ``x_scales``: the precast ``x_fp8`` (both or neither); ``mxfp4``: MXFP4 QAT."""
    host = _host(m_indices)
    out, x_q = _grouped_forward(x, weight, m_indices, host, fp8, None,
                                None if x_values is None else (x_values, x_scales), mxfp4)
    if fp8 and fp8_cache and x_values is None:
        return out.contiguous(), x_q[0].view(torch.uint8), x_q[1], host
    return out.contiguous(), x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32), host


@_grouped_linear_op.register_fake
def _(x, weight, m_indices, fp8, fp8_cache, x_values, x_scales, mxfp4=False):
    out = x.new_empty(x.shape[0], weight.shape[1])
    host = torch.empty(m_indices.shape, dtype=m_indices.dtype, device="cpu")
    if fp8 and fp8_cache and x_values is None:
        k = align(x.shape[1], BLOCK)
        return out, x.new_empty(x.shape[0], k, dtype=torch.uint8), x.new_empty(
            x.shape[0], k // (MX_BLOCK if fp8 == "mxfp8" else BLOCK), dtype=torch.float32), host
    return out, x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32), host


@registry.library_op("dsv3::grouped_linear_backward")
def _grouped_linear_backward_op(grad_out: torch.Tensor, saved: list[torch.Tensor], weight: torch.Tensor,
                                m_indices: torch.Tensor, host: torch.Tensor, fp8: str | None, cached: bool,
                                x_dtype: torch.dtype, input_grad: bool, weight_grad: bool, mxfp4: bool = False
                                ) -> torch.Tensor:
    grad_x = _grouped_backward(grad_out, saved, weight, m_indices, host, fp8, cached, x_dtype,
                               None, input_grad, weight_grad, mxfp4)
    return grad_out.new_empty(0) if grad_x is None else grad_x.contiguous()


@_grouped_linear_backward_op.register_fake
def _(grad_out, saved, weight, m_indices, host, fp8, cached, x_dtype, input_grad, weight_grad, mxfp4=False):
    if not input_grad:
        return grad_out.new_empty(0)
    return grad_out.new_empty(m_indices.shape[0], weight.shape[2], dtype=x_dtype)


def _grouped_setup(ctx, inputs, output) -> None:
    x, weight, m_indices, fp8, fp8_cache, x_values, x_scales, mxfp4 = inputs
    _, values, scales, host = output
    cached = bool(fp8) and fp8_cache
    if not cached:
        kept = (x,)
    else:  # the precast as given, or the op's own cast (handed over as bytes)
        kept = (x_values, x_scales) if x_values is not None else (values.view(FP8), scales)
    ctx.save_for_backward(*kept, m_indices, host)
    ctx.weight = weight  # the parameter itself, as in _LinearFunction
    ctx.meta = (fp8, cached, x.dtype, mxfp4)
    ctx.mark_non_differentiable(values, scales, host)


def _grouped_autograd(ctx, grad_out: torch.Tensor, _dvalues, _dscales, _dhost):
    *saved_x, m_indices, host = ctx.saved_tensors
    fp8, cached, x_dtype, mxfp4 = ctx.meta
    input_grad = ctx.needs_input_grad[0]
    grad_x = _grouped_linear_backward_op(grad_out, saved_x, ctx.weight, m_indices, host, fp8, cached, x_dtype,
                                         input_grad, ctx.needs_input_grad[1], mxfp4)
    return (grad_x if input_grad else None), None, None, None, None, None, None, None


_grouped_linear_op.register_autograd(_grouped_autograd, setup_context=_grouped_setup)
has_side_effect(torch.ops.dsv3.grouped_linear_backward.default)  # as dsv3::linear_backward's


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, fp8: bool | str = False,
                   fp8_cache: bool = False, health: Fp8Health | None = None,
                   x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None, weight_format: str = "bf16") -> torch.Tensor:
    """Per-row expert GEMM: ``out[r] = x[r] @ weight[m_indices[r]]^T``; rows with ``m_indices == -1`` give 0.

    ``x [M, K]`` in the contiguous grouped layout (each group padded to 128 rows, M a multiple of
    128), ``weight [G, N, K]``. Backward: dgrad by the grouped nn GEMM, wgrad by the k-grouped tn
    GEMM (deferred through ``accel.wgrad``); padding rows get zero gradients. ``fp8_cache`` (with
    ``fp8``): ``x`` is kept for the weight gradient only as the forward's e4m3 + 1x128 cast (see ``linear``).
    ``health``, ``x_fp8``: as in ``linear`` (a precast's padding rows are ignored: the fused permute writes
    zeros there, a plain cast of ``x`` whatever ``x`` holds). ``weight_format``: ``bf16`` the weight as stored,
    ``fp8`` as V3's FP8 GEMM casts it (needs ``fp8``), ``mxfp4_qat`` quantisation-aware training in MXFP4
    (``deep_gemm.mxfp4``: forward and dgrad through the FP4 weight, the weight gradient straight through to the
    parameter; with ``fp8="mxfp8"`` the FP8 GEMMs take the FP4 weight, exactly in the forward; with blockwise FP8
    the forward is the FP8 x MXFP4 grouped GEMM on the 1x128 rows and the packed FP4 weight, the dgrad the 1x128
    cast of dY times the dequantised FP4 weight in fp32, the wgrad blockwise FP8 as without QAT).
    """
    if weight_format not in EXPERT_WEIGHT_FORMATS:
        raise ValueError(f"grouped_linear: weight_format must be one of {', '.join(EXPERT_WEIGHT_FORMATS)}, "
                         f"got {weight_format!r}")
    if weight_format == "fp8" and not fp8:
        raise ValueError(f"grouped_linear: weight_format='fp8' needs fp8 on (the FP8 GEMM casts the weight), got "
                         f"fp8={fp8!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [M, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"weight must be [G, N, K] with K = {x.shape[1]} (x's last dim), "
                         f"got {list(getattr(weight, 'shape', []))}")
    if not isinstance(m_indices, torch.Tensor) or m_indices.shape != (x.shape[0],) or m_indices.is_floating_point():
        raise ValueError(f"m_indices must be an integer tensor [{x.shape[0]}] (x's rows), "
                         f"got {getattr(m_indices, 'shape', type(m_indices).__name__)}")
    m_indices = m_indices.to(torch.int32).contiguous()
    x_q = None if x_fp8 is None or not takes_precast(fp8) else _precast(x_fp8, x, x.shape[0], x.shape[1])
    health = health if health is not None and health.active else None
    mxfp4 = weight_format == "mxfp4_qat"
    if health is not None:
        return _GroupedLinearFunction.apply(x, weight, m_indices, fp8_recipe(fp8), bool(fp8_cache), health, x_q, mxfp4)
    return _grouped_linear_op(x, weight, m_indices, fp8_recipe(fp8), bool(fp8_cache), *(x_q or (None, None)),
                              mxfp4)[0]


class GroupedLinear(nn.Module):
    """``num_groups`` experts' linear layers (no bias) over rows in the contiguous grouped layout."""

    def __init__(self, num_groups: int, in_features: int, out_features: int, fp8: bool | str = False, device=None,
                 dtype=None, fp8_cache: bool = False):
        fp8_recipe(fp8)
        super().__init__()
        self.num_groups, self.in_features, self.out_features, self.fp8 = num_groups, in_features, out_features, fp8
        self.fp8_cache = fp8_cache
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default (kaiming_uniform with a = sqrt(5))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, m_indices: torch.Tensor,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return grouped_linear(x, self.weight, m_indices, fp8=self.fp8, fp8_cache=self.fp8_cache, x_fp8=x_fp8)

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"fp8={self.fp8}, fp8_cache={self.fp8_cache}"
