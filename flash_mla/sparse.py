"""DeepSeek-V3.2 sparse attention (DSA) over the MLA latent: ``flash_mla_sparse_fwd`` and ``sparse_mla_attention``.

Absorbed MQA form: every query head attends to one shared 576-wide key per token (512 latent + 64 RoPE);
the value is the first ``d_v`` (512) columns of that same row. Each query attends only to the keys its
``indices`` row names (the indexer's top-k):

* ``flash_mla_sparse_fwd`` keeps FlashMLA's API (inference prefill): ``q [s_q, h_q, d_qk]``,
  ``kv [s_kv, 1, d_qk]``, ``indices int32 [s_q, 1, topk]`` -> ``(out [s_q, h_q, d_v], max_logits, lse)``.
* ``sparse_mla_attention`` is the training op FlashMLA lacks: ``kv [s_kv, d_qk]``,
  ``indices [s_q, topk]`` -> ``out``, differentiable in ``q`` and ``kv`` (``dkv`` sums over heads and over
  every query that selected the key; ``kv[:, :d_v]`` gets both its key and its value gradient).

Conventions (FlashMLA's, checked against its README and its reference test):

* an index that is negative or ``>= s_kv`` is ignored (its slot is never read);
* a key listed twice in a row counts twice (the gather semantics of FlashMLA's reference: both copies
  enter the softmax, and both add to the key's gradient);
* ``max_logits`` and ``lse`` are in base 2: ``P = q.k * sm_scale * log2(e)``, ``max_logits = max P``,
  ``lse = log2(sum 2^P)``;
* a query with no valid index gets ``out = 0``, ``max_logits = -inf`` and ``lse = +inf`` (FlashMLA's
  reference sets the lonely rows' lse to +inf "so that the corresponding O will be 0"; the dense decode
  kernel uses +inf too).

Rows of ``kv`` are global: there is no batch dimension. A batch or a packed set of variable-length sequences
is one flattened ``kv`` with each sequence's indices offset by the row where the sequence starts (and -1 for
unused top-k slots), exactly as FlashMLA asks of its users; an index that is invalid within its own sequence must
be made -1 before the offset, or it names a row of the next sequence.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from flash_mla.compare import compare_decode

FWD_OP = "flash_mla.flash_mla_sparse_fwd"
TRAIN_OP = "flash_mla.sparse_mla_attention"
BWD_OP = "flash_mla.sparse_mla_attention_backward"
LOG2E = 1.4426950408889634
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, fn: str, kv_dims: int) -> None:
    """Shapes and dtypes of both ops (``kv_dims`` 3: FlashMLA's ``[s_kv, 1, d]``; 2: the training ``[s_kv, d]``)."""
    idx_dims = kv_dims
    kv_shape = "[s_kv, 1, d_qk]" if kv_dims == 3 else "[s_kv, d_qk]"
    idx_shape = "[s_q, 1, topk]" if kv_dims == 3 else "[s_q, topk]"
    for name, t, dims, shape in (("q", q, 3, "[s_q, h_q, d_qk]"), ("kv", kv, kv_dims, kv_shape),
                                 ("indices", indices, idx_dims, idx_shape)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"{fn}: {name} must be a {dims}-d tensor {shape}, got {tuple(getattr(t, 'shape', ()))}")
    if q.dtype not in _DTYPES or kv.dtype != q.dtype:
        raise ValueError(f"{fn}: q and kv must share a dtype among bfloat16, float16, float32; got {q.dtype} and "
                         f"{kv.dtype}")
    if indices.dtype != torch.int32:
        raise ValueError(f"{fn}: indices must be int32, got {indices.dtype}")
    if kv_dims == 3 and (kv.shape[1] != 1 or indices.shape[1] != 1):
        raise ValueError(f"{fn}: only h_kv = 1 is supported (MQA over the latent), got kv {tuple(kv.shape)} and "
                         f"indices {tuple(indices.shape)}")
    if kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"{fn}: kv's last dim must equal q's d_qk={q.shape[-1]}, got {kv.shape[-1]}")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: indices must have one row per query (s_q={q.shape[0]}), got {indices.shape[0]}")
    if kv.shape[0] < 1 or indices.shape[-1] < 1:
        raise ValueError(f"{fn}: kv needs at least one row and indices at least one column, got s_kv={kv.shape[0]}, "
                         f"topk={indices.shape[-1]}")
    if not 0 < d_v <= q.shape[-1]:
        raise ValueError(f"{fn}: d_v must be in [1, d_qk={q.shape[-1]}], got {d_v}")
    for name, t in (("kv", kv), ("indices", indices)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} must be on q's device {q.device}, got {t.device}")


def sparse_attention_math(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32, differentiable: (out [s_q, h_q, d_v] fp32, max_logits, lse) with base-2 stats (see the module doc).

    ``kv [s_kv, d]``, ``indices [s_q, topk]``. Invalid slots gather row 0 and are zeroed before any product,
    so a NaN in a row nobody selected never reaches a result. Memory: the gathered keys, ``[s_q, topk, d]``.
    """
    valid = (indices >= 0) & (indices < kv.shape[0])
    keys = kv.float()[indices.long().clamp(0, kv.shape[0] - 1)]
    keys = torch.where(valid[..., None], keys, 0.0)
    live = valid.any(-1)[:, None, None]  # rows with at least one key; the others are held at 0 (no NaN anywhere)
    scores = torch.einsum("shd,skd->shk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf).masked_fill(~live, 0.0)
    lse = scores.logsumexp(-1, keepdim=True)
    out = torch.einsum("shk,skd->shd", torch.exp(scores - lse) * live, keys[..., :d_v])
    live = live[..., 0]
    max_logits = torch.where(live, scores.amax(-1) * LOG2E, -math.inf)
    return out, max_logits, torch.where(live, lse[..., 0] * LOG2E, math.inf)


@registry.reference_for(FWD_OP)
def flash_mla_sparse_fwd_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                   d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse prefill in fp32 PyTorch; out in q's dtype, max_logits and lse fp32 (base 2)."""
    out, max_logits, lse = sparse_attention_math(q, kv[:, 0], indices[:, 0], sm_scale, d_v)
    return out.to(q.dtype), max_logits, lse


def random_selection(s_q: int, s_kv: int, topk: int, generator: torch.Generator, causal: bool = True
                     ) -> torch.Tensor:
    """int32 ``[s_q, topk]`` index rows in the shape DSA produces, with every case the kernels must handle:
    query t picks among keys ``<= t`` (causal, so early rows have fewer candidates than ``topk`` and pad
    with -1), then some slots are replaced by duplicates, by -1 and by ``s_kv`` (out of range), and every
    row is shuffled (invalid slots anywhere, not only at the end)."""
    rows = []
    for t in range(s_q):
        visible = min(s_kv, t + 1) if causal else s_kv
        chosen = torch.randperm(visible, generator=generator)[:topk]
        row = torch.full((topk,), -1, dtype=torch.int64)
        row[: chosen.numel()] = chosen
        rows.append(row)
    idx = torch.stack(rows)
    roll = torch.rand(s_q, topk, generator=generator)
    dup_src = idx[:, :1].expand(-1, topk)
    idx = torch.where((roll < 0.1) & (dup_src >= 0), dup_src, idx)
    idx = torch.where((roll >= 0.1) & (roll < 0.15), torch.full_like(idx, -1), idx)
    idx = torch.where((roll >= 0.15) & (roll < 0.18), torch.full_like(idx, s_kv), idx)
    order = torch.rand(s_q, topk, generator=generator).argsort(-1)
    return idx.gather(1, order).to(torch.int32)


def poison_unselected(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``kv [s_kv, ...]`` with every row that no valid index names set to NaN (in place; returned)."""
    flat = indices.reshape(-1).long()
    used = torch.zeros(kv.shape[0], dtype=torch.bool, device=kv.device)
    used[flat[(flat >= 0) & (flat < kv.shape[0])]] = True
    kv[~used] = float("nan")
    return kv


def _inputs(shape: dict, seed: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s_q, s_kv, h, d, topk = shape["s_q"], shape["s_kv"], shape["h"], shape.get("d_qk", 576), shape["topk"]
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    q = torch.randn(s_q, h, d, generator=g).to(dtype)
    kv = torch.randn(s_kv, d, generator=g).to(dtype)
    if shape.get("bench"):  # GPU-sized: every row valid, no shuffling on the host
        idx = torch.randint(0, s_kv, (s_q, topk), generator=g, dtype=torch.int32)
    else:
        idx = random_selection(s_q, s_kv, topk, g, causal=s_q <= s_kv)
        poison_unselected(kv, idx)
    return q.to(device), kv.to(device), idx.to(device), d ** -0.5, shape.get("d_v", 512)


def _make_fwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, kv, idx, scale, d_v = _inputs(shape, seed, device)
    return Case(args=(q, kv[:, None], idx[:, None], scale), kwargs={"d_v": d_v})


def compare_sparse(got, want) -> dict[str, tuple[float, float]]:
    """out: cosine diff < 1e-5 (FlashMLA's pass mark; bf16 rounding of out alone is ~1e-6); max_logits and
    lse: relative error < 1e-5 with the same Inf positions (fp32 scores of length-576 dot products)."""
    result = compare_decode((got["out[0]"], got["out[2]"]), (want["out[0]"], want["out[2]"]))
    result["max_logits"] = compare_decode((got["out[0]"], got["out[1]"]), (want["out[0]"], want["out[1]"]))["lse"]
    return result


def _fwd_flops(shape: dict) -> float:
    return 2.0 * shape["s_q"] * shape["h"] * shape["topk"] * (shape.get("d_qk", 576) + shape.get("d_v", 512))


_FWD_SHAPES = [dict(s_q=19, s_kv=40, h=16, topk=24, d_qk=48, d_v=32), dict(s_q=5, s_kv=70, h=16, topk=16)]
_BENCH = [dict(s_q=4096, s_kv=s, h=128, topk=2048, bench=True) for s in (8192, 32768)]

flash_mla_sparse_fwd_op = registry.register(
    FWD_OP,
    reference=flash_mla_sparse_fwd_reference,
    triton="flash_mla.kernels.sparse:sparse_fwd_triton",
    verify=VerifySpec(make_case=_make_fwd_case, shapes=_FWD_SHAPES, bench_shapes=_BENCH, compare=compare_sparse,
                      flops=_fwd_flops),
)


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill (FlashMLA's API): ``(out [s_q, h_q, d_v], max_logits fp32 [s_q, h_q], lse fp32
    [s_q, h_q])``, both stats base 2 (module docstring). ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]`` (q's
    dtype), ``indices int32 [s_q, 1, topk]``: -1 or ``>= s_kv`` entries are ignored."""
    _check(q, kv, indices, d_v, "flash_mla_sparse_fwd", kv_dims=3)
    return _sparse_fwd_torch_op(q, kv, indices, float(sm_scale), d_v)


@registry.reference_for(TRAIN_OP)
def sparse_mla_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                   d_v: int = 512) -> torch.Tensor:
    """Differentiable fp32 sparse attention (autograd through the gather); out in q's dtype. Also what the
    model trains with on a CPU."""
    return sparse_attention_math(q, kv, indices, sm_scale, d_v)[0].to(q.dtype)


def _make_train_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, kv, idx, scale, d_v = _inputs(shape, seed, device)
    return Case(args=(q, kv, idx, scale), kwargs={"d_v": d_v})


def sparse_mla_attention_forward_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                           sm_scale: float, d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The training op's reference: ``(out, lse)``, lse base 2 ``[s_q, h_q]`` as the Triton forward keeps it."""
    out, _, lse = sparse_attention_math(q, kv, indices, sm_scale, d_v)
    return out.to(q.dtype), lse


sparse_mla_attention_op = registry.register(
    TRAIN_OP,
    reference=sparse_mla_attention_forward_reference,
    triton="flash_mla.kernels.sparse:sparse_mla_attention_triton",
    verify=VerifySpec(make_case=_make_train_case, shapes=_FWD_SHAPES, bench_shapes=_BENCH, tolerance=1e-5,
                      flops=_fwd_flops),
)


@registry.reference_for(BWD_OP)
def sparse_mla_attention_backward_reference(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                                            indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                            sm_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv) of ``sparse_attention_math`` in fp32, written out (an op body runs below autograd): P recomputed
    with the forward's ops, ``dS = P * (dP - rowsum(dP * P))``, each gathered key's gradient added back into its
    row of ``kv`` (a duplicate adds twice). ``out`` and ``lse`` (what the Triton forward keeps) are not read."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    rows = indices.long().clamp(0, kv.shape[0] - 1)
    keys = torch.where(valid[..., None], kv.float()[rows], 0.0)
    live = valid.any(-1)[:, None, None]
    q32, do = q.float(), dout.float()
    scores = torch.einsum("shd,skd->shk", q32, keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf).masked_fill(~live, 0.0)
    p = torch.exp(scores - scores.logsumexp(-1, keepdim=True)) * live
    dp = torch.einsum("shd,skd->shk", do, keys[..., :d_v])
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.einsum("shk,skd->shd", ds, keys) * sm_scale
    dkeys = torch.einsum("shk,shd->skd", ds, q32) * sm_scale
    dkeys[..., :d_v] += torch.einsum("shk,shd->skd", p, do)
    dkeys = torch.where(valid[..., None], dkeys, 0.0)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dkv.index_put_((rows.reshape(-1),), dkeys.reshape(-1, kv.shape[-1]), accumulate=True)
    return dq.to(q.dtype), dkv.to(kv.dtype)


def _make_bwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    q, kv, idx, scale, d_v = _inputs(shape, seed, device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(q.shape[0], q.shape[1], d_v, generator=g).to(device=device, dtype=q.dtype)
    out, _, lse = sparse_attention_math(q, kv, idx, scale, d_v)
    return Case(args=(dout, q, kv, idx, out.to(q.dtype), lse, scale, d_v))


def _bwd_flops(shape: dict) -> float:
    d, d_v = shape.get("d_qk", 576), shape.get("d_v", 512)
    return 2.0 * shape["s_q"] * shape["h"] * shape["topk"] * (3 * d + 2 * d_v)  # QK^T again, dP, dQ, dK, dV


sparse_mla_attention_backward_op = registry.register(
    BWD_OP,
    reference=sparse_mla_attention_backward_reference,
    triton="flash_mla.kernels.sparse:sparse_backward_triton",
    verify=VerifySpec(
        make_case=_make_bwd_case,
        shapes=_FWD_SHAPES[:1],
        bench_shapes=_BENCH,
        # bf16 gradients, and on a GPU P and dS rounded to bf16 for the tensor cores (as every flash backward);
        # 1e-4 still flags any masking or indexing bug (those are > 1e-2).
        tolerance=1e-4,
        flops=_bwd_flops,
    ),
)


# The torch ops (docs/custom_ops.md). The training op's registered autograd keeps what the implementation that
# ran needs (Triton: out and its lse too) and calls the backward op.
@registry.torch_op(flash_mla_sparse_fwd_op)
def _sparse_fwd_torch_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_mla_sparse_fwd_op(q, kv, indices, sm_scale, d_v)


@registry.torch_op(sparse_mla_attention_backward_op)
def _sparse_backward_torch_op(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, sm_scale: float,
                              d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dkv = sparse_mla_attention_backward_op(dout, q, kv, indices, out, lse, sm_scale, d_v)
    return dq.contiguous(), dkv.contiguous()  # one layout whichever implementation ran


def _setup(ctx, inputs, output) -> None:
    q, kv, indices, sm_scale, d_v = inputs
    out, lse = output
    # what the backward that will run needs (the registry's choice): the Triton one reads out and lse too
    triton = sparse_mla_attention_backward_op.resolve(q.device)[0] == "triton"
    ctx.save_for_backward(q, kv, indices, *((out, lse) if triton else ()))
    ctx.args = (sm_scale, d_v)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, kv, indices, *kept = ctx.saved_tensors
    out, lse = kept or (q.new_empty(0), q.new_empty(0, dtype=torch.float32))
    dq, dkv = _sparse_backward_torch_op(dout, q, kv, indices, out, lse, *ctx.args)
    return dq, dkv, None, None, None


@registry.torch_op(sparse_mla_attention_op, backward=_backward, setup_context=_setup)
def _sparse_mla_attention_torch_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                   d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_mla_attention_op(q, kv, indices, sm_scale, d_v)


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                         d_v: int = 512) -> torch.Tensor:
    """Sparse MLA attention for training: ``out [s_q, h_q, d_v]``, differentiable in ``q`` and ``kv``.

    ``q [s_q, h_q, d_qk]``; ``kv [s_kv, d_qk]`` the shared latent (its first ``d_v`` columns are the value);
    ``indices int32 [s_q, topk]`` rows of ``kv`` (global: offset each packed sequence's indices by its first
    row), -1 or ``>= s_kv`` ignored, duplicates counted twice. A query with no valid index gets 0.
    """
    _check(q, kv, indices, d_v, "sparse_mla_attention", kv_dims=2)
    return _sparse_mla_attention_torch_op(q, kv, indices, float(sm_scale), d_v)[0]
