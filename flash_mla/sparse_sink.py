"""DeepSeek-V4 sparse attention: ``sparse_sink_attention``, V3.2's sparse kernel with V4's head and sink.

V4's attention has one shared 512-wide head that is both the key and the value (``kv [s_kv, d]``, K = V, so a
gathered row serves both products and is read once), a learned logit per query head that joins every row's
softmax and carries no value (the "attention sink"), and per query a list of rows of ``kv`` to attend: its
128-token sliding window plus the compressed entries the layer shows it (every causally visible one for HCA,
the indexer's top-k for CSA). With ``s = q.k * sm_scale`` over the listed rows:

    out = sum_j exp(s_j - lse) kv_j,    lse = log(exp(sink) + sum_j exp(s_j))

Index conventions are V3.2's (``flash_mla.sparse``): -1 or ``>= s_kv`` is ignored, a row listed twice counts
twice, rows are global (a batch or packed sequences is one flattened ``kv`` with offset indices). A query with
no valid index gets ``out = 0`` and ``lse = sink`` (the sink takes all the weight). The op returns
``(out, lse)``, lse base 2 (``lse * log2(e)``, what the Triton backward reads); the gradient reaches ``q``,
``kv`` (key and value parts summed: K = V) and ``sink`` (``-sum_t P_sink * rowsum(dO * O)``).
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from flash_mla.sparse import poison_unselected, random_selection

OP = "flash_mla.sparse_sink_attention"
BWD_OP = "flash_mla.sparse_sink_attention_backward"
LOG2E = 1.4426950408889634
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor) -> None:
    """Shapes, dtypes and devices of ``sparse_sink_attention``'s arguments (a one-line ``ValueError``)."""
    fn = "sparse_sink_attention"
    for name, t, dims, shape in (("q", q, 3, "[s_q, h_q, d]"), ("kv", kv, 2, "[s_kv, d]"),
                                 ("indices", indices, 2, "[s_q, topk]"), ("sink", sink, 1, "[h_q]")):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{fn}: {name} must be a {dims}-d tensor {shape}, got {tuple(getattr(t, 'shape', ()))}")
    if q.dtype not in _DTYPES or kv.dtype != q.dtype:
        raise ValueError(f"{fn}: q and kv must share a dtype among bfloat16, float16, float32; got {q.dtype} and "
                         f"{kv.dtype}")
    if sink.dtype not in _DTYPES:
        raise ValueError(f"{fn}: sink must be bfloat16, float16 or float32, got {sink.dtype}")
    if indices.dtype != torch.int32:
        raise ValueError(f"{fn}: indices must be int32, got {indices.dtype}")
    if kv.shape[1] != q.shape[2]:
        raise ValueError(f"{fn}: kv's last dim must equal q's d={q.shape[2]}, got {kv.shape[1]}")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: indices must have one row per query (s_q={q.shape[0]}), got {indices.shape[0]}")
    if sink.shape[0] != q.shape[1]:
        raise ValueError(f"{fn}: sink must have one logit per head (h_q={q.shape[1]}), got {sink.shape[0]}")
    if kv.shape[0] < 1 or indices.shape[1] < 1:
        raise ValueError(f"{fn}: kv needs at least one row and indices at least one column, got s_kv={kv.shape[0]}, "
                         f"topk={indices.shape[1]}")
    for name, t in (("kv", kv), ("indices", indices), ("sink", sink)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} must be on q's device {q.device}, got {t.device}")


def _scores(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [s_q, topk], gathered keys fp32 [s_q, topk, d] with invalid slots 0, scores fp32 [s_q, h_q, topk]
    with invalid slots -inf). Invalid slots gather row 0 and are zeroed before any product, so a NaN in a row
    nobody selected never reaches a result."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    keys = torch.where(valid[..., None], kv.float()[indices.long().clamp(0, kv.shape[0] - 1)], 0.0)
    scores = torch.einsum("shd,skd->shk", q.float(), keys) * sm_scale
    return valid, keys, scores.masked_fill(~valid[:, None, :], -math.inf)


@registry.reference_for(OP)
def sparse_sink_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                                    sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 math: ``(out [s_q, h_q, d] in q's dtype, lse fp32 [s_q, h_q] base 2)``; also the CPU path."""
    _, keys, scores = _scores(q, kv, indices, sm_scale)
    lse = torch.logaddexp(scores.logsumexp(-1), sink.float())  # finite: the sink is always in the row
    out = torch.einsum("shk,skd->shd", torch.exp(scores - lse[..., None]), keys)
    return out.to(q.dtype), lse * LOG2E


@registry.reference_for(BWD_OP)
def sparse_sink_attention_backward_reference(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                                             indices: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
                                             lse: torch.Tensor, sm_scale: float
                                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dkv, dsink) in fp32 math, written out (an op body runs below autograd): P recomputed with the
    forward's ops, ``dS = P * (dP - delta)`` with ``delta = rowsum(dP * P) = rowsum(dO * O)``, each gathered
    key's key and value gradients added back into its row of ``kv``, ``dsink = -sum_t P_sink * delta``.
    ``out`` and ``lse`` (what the Triton backward reads) are not read."""
    valid, keys, scores = _scores(q, kv, indices, sm_scale)
    lse_e = torch.logaddexp(scores.logsumexp(-1), sink.float())
    p = torch.exp(scores - lse_e[..., None])
    q32, do = q.float(), dout.float()
    dp = torch.einsum("shd,skd->shk", do, keys)
    delta = (dp * p).sum(-1)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("shk,skd->shd", ds, keys) * sm_scale
    dkeys = torch.einsum("shk,shd->skd", ds, q32) * sm_scale + torch.einsum("shk,shd->skd", p, do)
    dkeys = torch.where(valid[..., None], dkeys, 0.0)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dkv.index_put_((indices.long().clamp(0, kv.shape[0] - 1).reshape(-1),), dkeys.reshape(-1, kv.shape[1]),
                   accumulate=True)
    dsink = -(torch.exp(sink.float() - lse_e) * delta).sum(0)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsink.to(sink.dtype)


def _inputs(shape: dict, seed: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s_q, s_kv, h, d, topk = shape["s_q"], shape["s_kv"], shape["h"], shape.get("d", 512), shape["topk"]
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    q = torch.randn(s_q, h, d, generator=g).to(dtype)
    kv = torch.randn(s_kv, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g) * 2  # fp32, as the model keeps it; spread so that it matters
    if shape.get("bench"):  # GPU-sized: every row valid, no shuffling on the host
        idx = torch.randint(0, s_kv, (s_q, topk), generator=g, dtype=torch.int32)
    else:
        idx = random_selection(s_q, s_kv, topk, g, causal=s_q <= s_kv)
        poison_unselected(kv, idx)
    return q.to(device), kv.to(device), idx.to(device), sink.to(device), d ** -0.5


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, kv, idx, sink, scale = _inputs(shape, seed, device)
    return Case(args=(q, kv, idx, sink, scale))


def _make_bwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, kv, idx, sink, scale = _inputs(shape, seed, device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=g).to(device=device, dtype=q.dtype)
    out, lse = sparse_sink_attention_reference(q, kv, idx, sink, scale)
    return Case(args=(dout, q, kv, idx, sink, out, lse, scale))


def _flops(shape: dict) -> float:
    return 4.0 * shape["s_q"] * shape["h"] * shape["topk"] * shape.get("d", 512)


def _bwd_flops(shape: dict) -> float:
    return 10.0 * shape["s_q"] * shape["h"] * shape["topk"] * shape.get("d", 512)  # QK^T, dP, dQ, dK, dV


# Odd sizes (d 40 padded to 64 inside the tiles, 5 heads in a 16-head tile), and V4's 512-wide head.
_SHAPES = [dict(s_q=11, s_kv=37, h=5, d=40, topk=19), dict(s_q=4, s_kv=90, h=16, d=512, topk=24)]
# V4-Flash (64 heads) and V4-Pro (128 heads) at 4K: 128-token window + 512 / 1024 compressed entries per query.
_BENCH = [dict(s_q=4096, s_kv=5120, h=64, topk=640, bench=True),
          dict(s_q=4096, s_kv=5120, h=128, topk=1152, bench=True)]

sparse_sink_attention_op = registry.register(
    OP,
    reference=sparse_sink_attention_reference,
    triton="flash_mla.kernels.sparse:sparse_sink_attention_triton",
    # bf16 out rounded once (calc_diff ~1e-6); lse fp32 scores of length-d dot products
    verify=VerifySpec(make_case=_make_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-5, flops=_flops),
)

sparse_sink_attention_backward_op = registry.register(
    BWD_OP,
    reference=sparse_sink_attention_backward_reference,
    triton="flash_mla.kernels.sparse:sparse_sink_attention_backward_triton",
    verify=VerifySpec(
        make_case=_make_bwd_case,
        shapes=_SHAPES[:1],
        bench_shapes=_BENCH,
        # as V3.2's sparse backward: bf16 gradients, and on a GPU P and dS rounded to bf16 for the tensor cores;
        # a masking, sink or indexing bug moves a result by > 1e-2
        tolerance=1e-4,
        flops=_bwd_flops,
        allow={"aten._to_copy": "dsink's fp32 accumulator (h_q values) cast to a non-fp32 sink's dtype"},
    ),
)


@registry.torch_op(sparse_sink_attention_backward_op)
def _backward_torch_op(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkv, dsink = sparse_sink_attention_backward_op(dout, q, kv, indices, sink, out, lse, sm_scale)
    return dq.contiguous(), dkv.contiguous(), dsink.contiguous()  # one layout whichever implementation ran


def _setup(ctx, inputs, output) -> None:
    q, kv, indices, sink, sm_scale = inputs
    out, lse = output
    # what the backward that will run needs (the registry's choice): the Triton one reads out and lse too
    triton = sparse_sink_attention_backward_op.resolve(q.device)[0] == "triton"
    ctx.save_for_backward(q, kv, indices, sink, *((out, lse) if triton else ()))
    ctx.sm_scale = sm_scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, kv, indices, sink, *kept = ctx.saved_tensors
    out, lse = kept or (q.new_empty(0), q.new_empty(0, dtype=torch.float32))
    dq, dkv, dsink = _backward_torch_op(dout, q, kv, indices, sink, out, lse, ctx.sm_scale)
    return dq, dkv, None, dsink, None


@registry.torch_op(sparse_sink_attention_op, backward=_backward, setup_context=_setup)
def _sparse_sink_attention_torch_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                                    sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_sink_attention_op(q, kv, indices, sink, sm_scale)


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                          sm_scale: float) -> torch.Tensor:
    """V4 sparse attention: ``out [s_q, h_q, d]`` in q's dtype, differentiable in ``q``, ``kv`` and ``sink``.

    ``q [s_q, h_q, d]``; ``kv [s_kv, d]`` the shared head, key and value at once; ``indices int32 [s_q, topk]``
    rows of ``kv`` per query (window + selected compressed entries; -1 or ``>= s_kv`` ignored, duplicates counted
    twice); ``sink [h_q]`` a natural-log logit per head in the softmax's denominator (module docstring).
    """
    _check(q, kv, indices, sink)
    return _sparse_sink_attention_torch_op(q, kv, indices, sink, float(sm_scale))[0]
