"""MLA attention for training: ``mla_attention`` (flash-attn layout), differentiable, with varlen batches.

Training uses MLA's "naive" form: every head has its own K (q/k head dim 128 nope + 64 rope = 192)
and V (128), so this is ordinary multi-head attention whose V head dim differs from the Q/K one.
The Triton path is a flash-attention forward that saves only ``out`` and the log-sum-exp, and a
backward that recomputes the probabilities block by block (no S x S matrix is ever stored).
The reference (``reference_attention``) is fp32 PyTorch attention that skips the key blocks a causal
query block cannot see; it is also what the model trains with on a CPU.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from flash_mla.compare import compare_decode
from flash_mla.reference_attention import blocked_attention, blocked_attention_backward, blocked_attention_forward

OP_NAME = "flash_mla.mla_attention"
BWD_OP_NAME = "flash_mla.mla_attention_backward"


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                max_seqlen: int | None) -> None:
    dims = 3 if cu_seqlens is not None else 4
    layout = "[total, heads, d] (cu_seqlens given)" if dims == 3 else "[batch, seq, heads, d]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mla_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"mla_attention: {name} must be {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"mla_attention: {name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"mla_attention: {name} must match q's dtype/device ({q.dtype}, {q.device}), "
                             f"got ({t.dtype}, {t.device})")
    if k.shape != q.shape[:-1] + k.shape[-1:] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"mla_attention: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"mla_attention: v must have shape {tuple(q.shape[:-1]) + ('dv',)}, got {tuple(v.shape)}")
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("mla_attention: max_seqlen is only meaningful with cu_seqlens")
        return
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"mla_attention: cu_seqlens must be int32 [n+1] with n >= 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"mla_attention: cu_seqlens must be on {q.device}, got {cu_seqlens.device}")
    host = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    if host[0] != 0 or host[-1] != q.shape[0] or min(lengths) < 0:
        raise ValueError(f"mla_attention: cu_seqlens must rise from 0 to total={q.shape[0]}, got {host}")
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise ValueError(f"mla_attention: max_seqlen={max_seqlen} but the longest sequence has {max(lengths)} tokens")


@registry.reference_for(OP_NAME)
def mla_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                            max_seqlen: int | None = None) -> torch.Tensor:
    """Softmax attention in fp32 with causal block skipping (``reference_attention``), differentiable; out in
    q's dtype."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens is None:
        return blocked_attention(q, k, v, causal, scale).to(q.dtype)
    bounds = cu_seqlens.tolist()
    outs = [
        blocked_attention(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), causal, scale).squeeze(0)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=0).to(q.dtype)


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, s, h, dqk, dv = shape["b"], shape["s"], shape["h"], shape["dqk"], shape["dv"]
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype) for d in (dqk, dqk, dv))
    return Case(args=(q, k, v), kwargs={"causal": shape.get("causal", True)})


def _flops(shape: dict) -> float:
    b, s, h, dqk, dv = shape["b"], shape["s"], shape["h"], shape["dqk"], shape["dv"]
    pairs = s * s / 2 if shape.get("causal", True) else s * s
    return 2.0 * b * h * pairs * (dqk + dv)


def mla_attention_forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                                    softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                                    max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's reference: ``(out, lse)``, lse natural-log fp32 ``[heads, total]`` as the kernel returns it (rows
    ``b * s + t`` in the batched layout), out bit for bit ``mla_attention_reference``'s."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens is None:
        out, lse = blocked_attention_forward(q, k, v, causal, scale, with_lse=True)
        return out.to(q.dtype), lse.transpose(0, 1).reshape(q.shape[2], -1)
    bounds = cu_seqlens.tolist()
    parts = [blocked_attention_forward(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), causal, scale,
                                       with_lse=True) for a, b in zip(bounds[:-1], bounds[1:])]
    return (torch.cat([o.squeeze(0) for o, _ in parts], dim=0).to(q.dtype),
            torch.cat([lse.squeeze(0) for _, lse in parts], dim=1))


def _compare_out(got, want) -> dict[str, tuple[float, float]]:
    """``out`` by calc_diff (the spec's 1e-4); ``lse`` (natural log, fp32 scores of short dot products) to a
    relative 1e-5 with the same infinities, as the decode ops' lse."""
    errors = compare_decode((got["out[0]"], got["out[1]"]), (want["out[0]"], want["out[1]"]))
    return {"out": (errors["out"][0], 1e-4), "lse": errors["lse"]}


mla_attention_op = registry.register(
    OP_NAME,
    reference=mla_attention_forward_reference,
    triton="flash_mla.kernels.attention:mla_attention_triton",  # imported at first use: no Triton needed here
    verify=VerifySpec(
        make_case=_make_case,
        # bf16 inputs: on a GPU the kernel rounds P to bf16 before P @ V like every flash kernel, the fp32
        # reference does not (cos diff ~1e-6); 1e-4 still flags any masking or indexing bug (those are > 1e-2).
        shapes=[dict(b=2, s=40, h=2, dqk=48, dv=32), dict(b=1, s=33, h=2, dqk=192, dv=128, causal=False)],
        bench_shapes=[dict(b=4, s=4096, h=16, dqk=192, dv=128), dict(b=1, s=8192, h=16, dqk=192, dv=128)],
        tolerance=1e-4,
        compare=_compare_out,
        flops=_flops,
    ),
)


@registry.reference_for(BWD_OP_NAME)
def mla_attention_backward_reference(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    """(dq, dk, dv) by the reference's own backward (``blocked_attention_backward``), per sequence with
    ``cu_seqlens``; ``out`` and ``lse`` (what the kernel saves) are not read: the reference recomputes."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens is None:
        return blocked_attention_backward(dout, q, k, v, causal, scale)
    bounds = cu_seqlens.tolist()
    parts = [blocked_attention_backward(*(t[a:b].unsqueeze(0) for t in (dout, q, k, v)), causal, scale)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return tuple(torch.cat([p[i].squeeze(0) for p in parts], dim=0) for i in range(3))


def reference_lse(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                  scale: float) -> torch.Tensor:
    """Natural-log row sums of exp(scores), fp32 ``[heads, total]``: what the forward kernel saves."""
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("ihd,jhd->hij", q[a:b].float(), k[a:b].float()) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        lse[:, a:b] = scores.logsumexp(-1)
    return lse


def _make_backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens, h, dqk, dv, causal = shape["lens"], shape["h"], shape["dqk"], shape["dv"], shape.get("causal", True)
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    total = sum(lens)
    q, k, v, dout = (torch.randn(total, h, d, generator=g).to(device=device, dtype=dtype) for d in (dqk, dqk, dv, dv))
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    scale = dqk ** -0.5
    out = mla_attention_reference.__wrapped__(q, k, v, causal, scale, cu, max(lens))
    return Case(args=(dout, q, k, v, out, reference_lse(q, k, cu, causal, scale), cu, max(lens), causal, scale))


def _backward_flops(shape: dict) -> float:
    lens, h, dqk, dv = shape["lens"], shape["h"], shape["dqk"], shape["dv"]
    pairs = sum(n * n / 2 if shape.get("causal", True) else n * n for n in lens)
    return 2.0 * h * pairs * (3 * dqk + 2 * dv)  # recompute QK^T, dV, dP, dQ, dK


mla_attention_backward_op = registry.register(
    BWD_OP_NAME,
    reference=mla_attention_backward_reference,
    triton="flash_mla.kernels.attention:mla_attention_backward_triton",
    verify=VerifySpec(
        make_case=_make_backward_case,
        # bf16: gradients rounded to bf16, delta = rowsum(dO * O) from the bf16 O, and on a GPU P and dS rounded
        # to bf16 for the tensor cores (interpreter: ~3e-6); 1e-4 still flags any masking or indexing bug (> 1e-2).
        shapes=[dict(lens=[9, 0, 20], h=2, dqk=48, dv=32), dict(lens=[24], h=1, dqk=192, dv=128, causal=False)],
        bench_shapes=[dict(lens=[4096] * 4, h=16, dqk=192, dv=128)],
        tolerance=1e-4,
        flops=_backward_flops,
    ),
)


def _backward_fake(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# The backward reads the sequence bounds on the host (the reference loops over them), so it is opaque.
@registry.torch_op(mla_attention_backward_op, fake=_backward_fake, opaque=True)
def _mla_attention_backward_torch_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor | None,
                                     max_seqlen: int | None, causal: bool, softmax_scale: float | None
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = mla_attention_backward_op(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale)
    return tuple(g.contiguous() for g in grads)  # the fake's layout whichever implementation ran


def _setup(ctx, inputs, output) -> None:
    """Keep what the backward that will run needs (the registry's choice for q's device): the Triton kernel
    ``out`` and ``lse`` too (flash backward), the reference only q, k, v (it recomputes)."""
    q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen = inputs
    out, lse = output
    kept = (out, lse) if keeps_output(q.device) else ()
    ctx.save_for_backward(q, k, v, cu_seqlens, *kept)
    ctx.args = (max_seqlen, causal, softmax_scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, cu_seqlens, *kept = ctx.saved_tensors
    out, lse = kept or (q.new_empty(0), q.new_empty(0, dtype=torch.float32))
    max_seqlen, causal, softmax_scale = ctx.args
    dq, dk, dv = _mla_attention_backward_torch_op(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal,
                                                  softmax_scale)
    return dq, dk, dv, None, None, None, None


def _forward_fake(q, k, v, causal=True, softmax_scale=None, cu_seqlens=None, max_seqlen=None):
    rows = q.shape[0] if cu_seqlens is not None else q.shape[0] * q.shape[1]
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[-2], rows, dtype=torch.float32)


@registry.torch_op(mla_attention_op, backward=_backward, setup_context=_setup, fake=_forward_fake)
def _mla_attention_torch_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                            max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_attention_op(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)


def keeps_output(device: torch.device) -> bool:
    """Whether ``mla_attention`` on ``device`` keeps its output for backward: the Triton (flash) kernel does
    (``delta = rowsum(dO * O)``), the reference recomputes it. A consumer of the output that needs it in
    backward (the Linear after attention) can then save that same tensor instead of a copy of its own."""
    return registry.implementation(OP_NAME, device) == "triton"


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                  max_seqlen: int | None = None) -> torch.Tensor:
    """Multi-head attention with separate Q/K and V head dims, differentiable.

    Layout as flash-attn: q/k ``[batch, seq, heads, dqk]``, v ``[batch, seq, heads, dv]`` -> out
    ``[batch, seq, heads, dv]``; with ``cu_seqlens`` (int32 ``[n+1]``, as ``flash_attn_varlen_func``)
    the tensors are ``[total, heads, d]`` and attention stays within each sequence. ``causal`` masks
    key j > query i. ``softmax_scale`` defaults to ``dqk ** -0.5``.
    """
    _check_args(q, k, v, cu_seqlens, max_seqlen)
    return _mla_attention_torch_op(q, k, v, causal, softmax_scale, cu_seqlens, max_seqlen)[0]
