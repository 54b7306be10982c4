"""MoE grouped GEMMs with DeepGEMM v2's names.

- ``m_grouped_*_contiguous``: the rows of A are grouped by expert, each group padded to
  ``get_m_alignment_for_contiguous_layout()`` (128) rows; ``m_indices[row]`` is the row's group or
  -1 for padding. Padding rows are skipped and their rows of ``d`` left untouched.
- ``m_grouped_*_masked``: A is ``[G, m_max, k]``; only the first ``masked_m[g]`` rows of group g
  are computed (the decode layout: fixed-size buffers filled by the dispatcher, no host sync).
- ``k_grouped_*_tn_contiguous``: the experts' weight gradients. Group g reduces over its own
  ``ks[g]`` rows of A ``[sum_k, m]`` and B ``[sum_k, n]``: ``d[g] = c[g] + A_g^T @ B_g``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from deep_gemm import reference
from deep_gemm.gemm import TRITON_ALLOW, _c_args, quantize_operand
from deep_gemm.utils import (
    BLOCK,
    FP8,
    M_ALIGNMENT,
    ceil_div,
    check_k,
    check_mx_pair,
    check_out,
    check_same_device,
    check_scale,
    check_tensor,
    kernel_scales,
    recipe_gran_k,
    unpack_pair,
)

_INT = (torch.int32,)


# ---------------------------------------------------------------- argument checks


def check_m_indices(m_indices: object, m: int, num_groups: int, rows_of: str = "a") -> None:
    """The contiguous layout: int32 ``[m]``, m a multiple of 128, ids in [-1, G), one group per 128-row block."""
    check_tensor("m_indices", m_indices, _INT, (m,))
    if m % M_ALIGNMENT:
        raise ValueError(f"{rows_of}: rows ({m}) must be a multiple of {M_ALIGNMENT}: pad each group to "
                         f"get_m_alignment_for_contiguous_layout() rows marked -1 in m_indices")
    if m == 0:
        return
    lo, hi = int(m_indices.min()), int(m_indices.max())
    if lo < -1 or hi >= num_groups:
        raise ValueError(f"m_indices must hold group ids in [0, {num_groups}) or -1 for padding, got [{lo}, {hi}]")
    blocks = m_indices.view(-1, M_ALIGNMENT)
    owner = blocks.amax(dim=1, keepdim=True)
    if bool(((blocks >= 0) & (blocks != owner)).any()):
        raise ValueError(f"m_indices: every block of {M_ALIGNMENT} rows must belong to one group (or be padding)")


def _check_grouped_b_fp8(b, num_groups: int | None, n_letters: str, k: int, gran_k: int | None = None):
    """B of the grouped ops: fp8 ``[G, n, k]`` (nt) or ``[G, k, n]`` (nn) with 128x128 block, 1x128 row or
    (MXFP8) 1x32 row scales; returns the scales in the kernels' form and whether they are MXFP8."""
    b_t, sfb = unpack_pair("b", b)
    check_tensor("b[0]", b_t, (FP8,), (num_groups, None, None))
    dims = dict(zip(n_letters, b_t.shape[1:]))
    if dims["k"] != k:
        raise ValueError(f"b[0] must be [g, {', '.join(n_letters)}] with k = {k} (from a[0]), got {list(b_t.shape)}: "
                         f"A and B disagree on K")
    n = dims["n"]
    g = b_t.shape[0]
    sfb, mx = kernel_scales("b[1] (scales of b)", sfb, k, n_letters.index("k") - 2, gran_k)
    blk = {"n": ceil_div(n, BLOCK), "k": k // BLOCK}
    per_row = {"n": n, "k": k // BLOCK}
    check_scale("b[1] (scales of b)", sfb, [(g, *(blk[ch] for ch in n_letters)),
                                            (g, *(per_row[ch] for ch in n_letters))])
    return b_t, sfb, g, n, mx


def _check_contiguous_fp8(a, b, d, m_indices, n_letters: str, recipe=None):
    a_t, sfa = unpack_pair("a", a)
    check_tensor("a[0]", a_t, (FP8,), (None, None))
    m, k = a_t.shape
    check_k("a[0]", k)
    gran_k = recipe_gran_k(recipe)
    sfa, a_mx = kernel_scales("a[1] (scales of a)", sfa, k, -1, gran_k)
    check_scale("a[1] (scales of a)", sfa, [(m, k // BLOCK)])
    b_t, sfb, g, n, b_mx = _check_grouped_b_fp8(b, None, n_letters, k, gran_k)
    check_mx_pair(a_mx, b_mx, sfb.shape[2 - n_letters.index("k")], n)
    check_out(d, (m, n), None, dtypes=(torch.bfloat16,))
    check_m_indices(m_indices, m, g)
    check_same_device(a=a_t, sfa=sfa, b=b_t, sfb=sfb, d=d, m_indices=m_indices)
    return (a_t, sfa), (b_t, sfb)


def _check_masked_m(masked_m: object, g: int, m_max: int, expected_m: object) -> None:
    check_tensor("masked_m", masked_m, _INT, (g,))
    if not isinstance(expected_m, int) or expected_m <= 0:
        raise ValueError(f"expected_m must be a positive int (typical rows per group), got {expected_m!r}")
    if g and (int(masked_m.min()) < 0 or int(masked_m.max()) > m_max):
        raise ValueError(f"masked_m values must lie in [0, {m_max}] (a's rows per group)")


def _check_masked_fp8(a, b, d, masked_m, expected_m):
    a_t, sfa = unpack_pair("a", a)
    check_tensor("a[0]", a_t, (FP8,), (None, None, None))
    g, m_max, k = a_t.shape
    check_k("a[0]", k)
    check_scale("a[1] (scales of a)", sfa, [(g, m_max, k // BLOCK)])
    b_t, sfb, _, n, mx = _check_grouped_b_fp8(b, g, "nk", k)
    if mx:
        raise ValueError("b[1]: the masked grouped GEMM takes blockwise scales (1x128 / 128x128), not MXFP8's 1x32")
    check_out(d, (g, m_max, n), None, dtypes=(torch.bfloat16,))
    _check_masked_m(masked_m, g, m_max, expected_m)
    check_same_device(a=a_t, sfa=sfa, b=b_t, sfb=sfb, d=d, masked_m=masked_m)


def _check_ks(ks: object, ks_tensor: object, sum_k: int, align: int) -> list[int]:
    if not isinstance(ks, (list, tuple)) or not all(isinstance(k, int) and k >= 0 for k in ks):
        raise ValueError(f"ks must be a list of non-negative ints (rows of A and B per group), got {ks!r}")
    if any(k % align for k in ks):
        raise ValueError(f"ks: every group's K must be a multiple of {align}, got {list(ks)}")
    if sum(ks) != sum_k:
        raise ValueError(f"ks must sum to a's rows ({sum_k}), got sum {sum(ks)}")
    if ks_tensor is not None:
        check_tensor("ks_tensor", ks_tensor, _INT, (len(ks),))
    return list(ks)


def _check_k_grouped_fp8(a, b, d, ks, ks_tensor, c, recipe=None):
    a_t, sfa = unpack_pair("a", a)
    b_t, sfb = unpack_pair("b", b)
    check_tensor("a[0]", a_t, (FP8,), (None, None))
    sum_k, m = a_t.shape
    check_tensor("b[0]", b_t, (FP8,), (sum_k, None))
    n = b_t.shape[1]
    ks = _check_ks(ks, ks_tensor, sum_k, BLOCK)
    gran_k = recipe_gran_k(recipe)
    sfa, a_mx = kernel_scales("a[1] (scales of a)", sfa, sum_k, -2, gran_k)
    sfb, b_mx = kernel_scales("b[1] (scales of b)", sfb, sum_k, -2, gran_k)
    check_scale("a[1] (scales of a)", sfa, [(sum_k // BLOCK, m)])
    check_scale("b[1] (scales of b)", sfb, [(sum_k // BLOCK, n)])
    check_mx_pair(a_mx, b_mx, n, n)
    check_out(d, (len(ks), m, n), c, dtypes=(torch.float32,))
    check_same_device(a=a_t, sfa=sfa, b=b_t, sfb=sfb, d=d, c=c)
    return (a_t, sfa), (b_t, sfb)


def _check_k_grouped_nt_fp8(a, b, d, ks, ks_tensor, c):
    a_t, sfa = unpack_pair("a", a)
    b_t, sfb = unpack_pair("b", b)
    check_tensor("d", d, (torch.float32,), (None, None, None))
    _, m, n = d.shape
    for name, t in (("a[0]", a_t), ("b[0]", b_t)):
        if not isinstance(t, torch.Tensor) or t.dtype != FP8 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float8_e4m3fn tensor (groups' K-major blocks packed)")
    sum_k = a_t.numel() // max(m, 1)
    ks = _check_ks(ks, ks_tensor, sum_k, BLOCK)
    if a_t.numel() != sum_k * m or b_t.numel() != sum_k * n:
        raise ValueError(f"a[0] must hold sum(ks) * m = {sum_k * m} and b[0] sum(ks) * n = {sum_k * n} values, "
                         f"got {a_t.numel()} and {b_t.numel()}")
    check_scale("a[1] (scales of a)", sfa, [(m, sum_k // BLOCK)])
    check_scale("b[1] (scales of b)", sfb, [(n, sum_k // BLOCK)])
    check_out(d, (len(ks), m, n), c, dtypes=(torch.float32,))
    check_same_device(a=a_t, sfa=sfa, b=b_t, sfb=sfb, d=d, c=c)


# ---------------------------------------------------------------- verification cases


def _group_sizes(gen: torch.Generator, groups: int, expected: int) -> list[int]:
    """Rows per group around ``expected`` (0.7x-1.3x, as DeepGEMM's tests), one group possibly empty."""
    sizes = [int(expected * (0.7 + 0.6 * torch.rand(1, generator=gen).item())) for _ in range(groups)]
    return sizes


def contiguous_layout(sizes: Sequence[int], device) -> torch.Tensor:
    """``m_indices`` for groups of ``sizes`` rows, each padded to 128 rows marked -1."""
    parts = []
    for g, size in enumerate(sizes):
        padded = ceil_div(size, M_ALIGNMENT) * M_ALIGNMENT
        parts += [torch.full((size,), g, dtype=torch.int32), torch.full((padded - size,), -1, dtype=torch.int32)]
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.int32, device=device)


def _make_contiguous_case(fp8: bool, nn: bool = False):
    def make(shape: dict, seed: int, device: torch.device) -> Case:
        gen = torch.Generator().manual_seed(seed)
        groups, n, k = shape["groups"], shape["n"], shape["k"]
        m_indices = contiguous_layout(_group_sizes(gen, groups, shape["m_per_group"]), device)
        m = m_indices.numel()
        a = torch.randn(m, k, generator=gen) * (m_indices.cpu() >= 0).unsqueeze(1)  # padding rows are zero
        b = torch.randn(groups, n, k, generator=gen)
        d = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        if fp8:
            a_op = tuple(t.to(device) for t in reference.cast_tiles(a, 1, BLOCK))
            b_store = b.transpose(1, 2).contiguous() if nn else b
            b_op = tuple(t.to(device) for t in reference.cast_tiles(b_store, BLOCK, BLOCK))
        else:
            a_op, b_op = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
        return Case(args=(a_op, b_op, d, m_indices), outputs=(2,))

    return make


def _make_masked_case(fp8: bool):
    def make(shape: dict, seed: int, device: torch.device) -> Case:
        gen = torch.Generator().manual_seed(seed)
        groups, m_max, n, k = shape["groups"], shape["m_max"], shape["n"], shape["k"]
        masked = [min(m_max, s) for s in _group_sizes(gen, groups, shape["expected_m"])]
        a = torch.randn(groups, m_max, k, generator=gen)
        b = torch.randn(groups, n, k, generator=gen)
        d = torch.empty(groups, m_max, n, dtype=torch.bfloat16, device=device)
        masked_m = torch.tensor(masked, dtype=torch.int32, device=device)
        if fp8:
            a_op = tuple(t.to(device) for t in reference.cast_tiles(a, 1, BLOCK))
            b_op = tuple(t.to(device) for t in reference.cast_tiles(b, BLOCK, BLOCK))
        else:
            a_op, b_op = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
        return Case(args=(a_op, b_op, d, masked_m, shape["expected_m"]), outputs=(2,))

    return make


def _make_k_grouped_case(fp8: bool):
    def make(shape: dict, seed: int, device: torch.device) -> Case:
        gen = torch.Generator().manual_seed(seed)
        ks, m, n = list(shape["ks"]), shape["m"], shape["n"]
        a = torch.randn(sum(ks), m, generator=gen)
        b = torch.randn(sum(ks), n, generator=gen)
        d = torch.empty(len(ks), m, n, dtype=torch.float32, device=device)
        c = (torch.randn(len(ks), m, n, generator=gen) * 4).to(device)
        if fp8:
            a_op = tuple(t.to(device) for t in quantize_operand(a.T, "km", per_block=False))
            b_op = tuple(t.to(device) for t in quantize_operand(b.T, "kn", per_block=False))
        else:
            a_op, b_op = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
        ks_tensor = torch.tensor(ks, dtype=torch.int32, device=device)
        return Case(args=(a_op, b_op, d, ks, ks_tensor, c), outputs=(2,))

    return make


def _make_k_grouped_nt_case(shape: dict, seed: int, device: torch.device) -> Case:
    """DeepGEMM's SM90 layout: each group's per-channel-quantized rows, transposed to K-major and packed."""
    tn = _make_k_grouped_case(True)(shape, seed, torch.device("cpu")).args
    (a, sfa), (b, sfb), d, ks, ks_tensor, c = tn
    a_flat = torch.cat([a[s:e].T.reshape(-1) for s, e in _bounds(ks)]) if ks else a.reshape(-1)
    b_flat = torch.cat([b[s:e].T.reshape(-1) for s, e in _bounds(ks)]) if ks else b.reshape(-1)
    return Case(args=((a_flat.to(device), sfa.T.to(device)), (b_flat.to(device), sfb.T.to(device)), d.to(device),
                      ks, ks_tensor.to(device), c.to(device)), outputs=(2,))


def _bounds(ks: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for k in ks:
        out.append((start, start + k))
        start += k
    return out


_CONTIGUOUS_SHAPES = [{"groups": 2, "m_per_group": 100, "n": 128, "k": 256},
                      {"groups": 3, "m_per_group": 40, "n": 256, "k": 128}]
_MASKED_SHAPES = [{"groups": 2, "m_max": 64, "expected_m": 40, "n": 128, "k": 256},
                  {"groups": 3, "m_max": 129, "expected_m": 100, "n": 256, "k": 128}]
_K_GROUPED_SHAPES = [{"ks": [128, 256], "m": 128, "n": 256}, {"ks": [256, 0, 128], "m": 256, "n": 128}]
# DeepSeek-V3 MoE shapes (DeepGEMM's README): experts' (n, k) for up/gate and down projections.
_MOE_NK = [(4096, 7168), (7168, 2048)]
_CONTIGUOUS_BENCH = [{"groups": g, "m_per_group": mg, "n": n, "k": k} for g, mg in ((4, 8192), (8, 4096))
                     for n, k in _MOE_NK]
_MASKED_BENCH = [{"groups": g, "m_max": 256, "expected_m": mg, "n": n, "k": k} for g, mg in ((16, 128), (32, 64))
                 for n, k in _MOE_NK]
_K_GROUPED_BENCH = [{"ks": [4096] * 4, "m": n, "n": k} for n, k in _MOE_NK]


def _flops_contiguous(s: dict) -> float:
    return 2.0 * s["groups"] * s["m_per_group"] * s["n"] * s["k"]


def _flops_masked(s: dict) -> float:
    return 2.0 * s["groups"] * s["expected_m"] * s["n"] * s["k"]


def _flops_k_grouped(s: dict) -> float:
    return 2.0 * sum(s["ks"]) * s["m"] * s["n"]


def _bytes_contiguous(s: dict) -> float:
    m = s["groups"] * s["m_per_group"]
    return float(m * s["k"] + s["groups"] * s["n"] * s["k"] + 2 * m * s["n"])


def _bytes_masked(s: dict) -> float:
    m = s["groups"] * s["expected_m"]
    return float(m * s["k"] + s["groups"] * s["n"] * s["k"] + 2 * m * s["n"])


def _bytes_k_grouped(s: dict) -> float:
    return float(sum(s["ks"]) * (s["m"] + s["n"]) + 8 * len(s["ks"]) * s["m"] * s["n"])


def _spec(make, shapes, bench, flops, bytes_moved) -> VerifySpec:
    # 1e-5: same FP8 inputs as the reference; only fp32 summation order and bf16 rounding differ.
    return VerifySpec(make_case=make, shapes=shapes, bench_shapes=bench, tolerance=1e-5, flops=flops,
                      bytes_moved=bytes_moved, allow={"aten.copy_": TRITON_ALLOW["aten.copy_"]})


_contiguous = registry.register(
    "deep_gemm.m_grouped_fp8_gemm_nt_contiguous", reference=reference.m_grouped_fp8_gemm_nt_contiguous_reference,
    triton="deep_gemm.kernels.gemm:m_grouped_contiguous",
    verify=_spec(_make_contiguous_case(True), _CONTIGUOUS_SHAPES, _CONTIGUOUS_BENCH, _flops_contiguous,
                 _bytes_contiguous))
_contiguous_nn = registry.register(
    "deep_gemm.m_grouped_fp8_gemm_nn_contiguous", reference=reference.m_grouped_fp8_gemm_nn_contiguous_reference,
    triton="deep_gemm.kernels.gemm:m_grouped_contiguous_nn",
    verify=_spec(_make_contiguous_case(True, nn=True), _CONTIGUOUS_SHAPES, _CONTIGUOUS_BENCH, _flops_contiguous,
                 _bytes_contiguous))
_contiguous_bf16 = registry.register(
    "deep_gemm.m_grouped_bf16_gemm_nt_contiguous", reference=reference.m_grouped_bf16_gemm_nt_contiguous_reference,
    triton="deep_gemm.kernels.gemm:m_grouped_contiguous",
    verify=_spec(_make_contiguous_case(False), _CONTIGUOUS_SHAPES, _CONTIGUOUS_BENCH, _flops_contiguous,
                 _bytes_contiguous))
_masked = registry.register(
    "deep_gemm.m_grouped_fp8_gemm_nt_masked", reference=reference.m_grouped_fp8_gemm_nt_masked_reference,
    triton="deep_gemm.kernels.gemm:m_grouped_masked",
    verify=_spec(_make_masked_case(True), _MASKED_SHAPES, _MASKED_BENCH, _flops_masked, _bytes_masked))
_masked_bf16 = registry.register(
    "deep_gemm.m_grouped_bf16_gemm_nt_masked", reference=reference.m_grouped_bf16_gemm_nt_masked_reference,
    triton="deep_gemm.kernels.gemm:m_grouped_masked",
    verify=_spec(_make_masked_case(False), _MASKED_SHAPES, _MASKED_BENCH, _flops_masked, _bytes_masked))
_k_grouped = registry.register(
    "deep_gemm.k_grouped_fp8_gemm_tn_contiguous", reference=reference.k_grouped_fp8_gemm_tn_contiguous_reference,
    triton="deep_gemm.kernels.gemm:k_grouped",
    verify=_spec(_make_k_grouped_case(True), _K_GROUPED_SHAPES, _K_GROUPED_BENCH, _flops_k_grouped,
                 _bytes_k_grouped))
_k_grouped_nt = registry.register(
    "deep_gemm.k_grouped_fp8_gemm_nt_contiguous", reference=reference.k_grouped_fp8_gemm_nt_contiguous_reference,
    triton="deep_gemm.kernels.gemm:k_grouped_packed",
    verify=_spec(_make_k_grouped_nt_case, _K_GROUPED_SHAPES, _K_GROUPED_BENCH, _flops_k_grouped, _bytes_k_grouped))
_k_grouped_bf16 = registry.register(
    "deep_gemm.k_grouped_bf16_gemm_tn_contiguous",
    reference=reference.k_grouped_bf16_gemm_tn_contiguous_reference, triton="deep_gemm.kernels.gemm:k_grouped",
    verify=_spec(_make_k_grouped_case(False), _K_GROUPED_SHAPES, _K_GROUPED_BENCH, _flops_k_grouped,
                 _bytes_k_grouped))


# The torch ops (docs/custom_ops.md); an FP8 operand is its ``[values, scales]`` list, ``d`` is written in place,
# no autograd (``grouped_linear`` owns it). The m-grouped references read the group layout on the host (a
# ``nonzero`` per group, ``masked_m`` as a list), which fake tensors and torch.compile cannot trace: those ops are
# opaque, with a fake that writes nothing (they only fill ``d``). The k-grouped ones take ``ks`` as a host list in
# the schema, so torch.compile traces their body.


def _no_fake(*args, **kwargs) -> None:
    """Fake of an op that only writes its ``d`` in place: nothing to compute or allocate."""


@registry.torch_op(_contiguous, mutates_args=("d",), fake=_no_fake, opaque=True)
def _contiguous_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, m_indices: torch.Tensor) -> None:
    _contiguous(tuple(a), tuple(b), d, m_indices)


@registry.torch_op(_contiguous_nn, mutates_args=("d",), fake=_no_fake, opaque=True)
def _contiguous_nn_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor,
                      m_indices: torch.Tensor) -> None:
    _contiguous_nn(tuple(a), tuple(b), d, m_indices)


@registry.torch_op(_contiguous_bf16, mutates_args=("d",), fake=_no_fake, opaque=True)
def _contiguous_bf16_op(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    _contiguous_bf16(a, b, d, m_indices)


@registry.torch_op(_masked, mutates_args=("d",), fake=_no_fake, opaque=True)
def _masked_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, masked_m: torch.Tensor,
               expected_m: int) -> None:
    _masked(tuple(a), tuple(b), d, masked_m, expected_m)


@registry.torch_op(_masked_bf16, mutates_args=("d",), fake=_no_fake, opaque=True)
def _masked_bf16_op(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                    expected_m: int) -> None:
    _masked_bf16(a, b, d, masked_m, expected_m)


@registry.torch_op(_k_grouped, mutates_args=("d",))
def _k_grouped_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, ks: list[int],
                  ks_tensor: torch.Tensor | None = None, c: torch.Tensor | None = None,
                  accumulate: bool = False) -> None:
    _k_grouped(tuple(a), tuple(b), d, list(ks), ks_tensor, d if accumulate and c is None else c)


@registry.torch_op(_k_grouped_nt, mutates_args=("d",))
def _k_grouped_nt_op(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, ks: list[int],
                     ks_tensor: torch.Tensor | None = None, c: torch.Tensor | None = None,
                     accumulate: bool = False) -> None:
    _k_grouped_nt(tuple(a), tuple(b), d, list(ks), ks_tensor, d if accumulate and c is None else c)


@registry.torch_op(_k_grouped_bf16, mutates_args=("d",))
def _k_grouped_bf16_op(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, ks: list[int],
                       ks_tensor: torch.Tensor | None = None, c: torch.Tensor | None = None,
                       accumulate: bool = False) -> None:
    _k_grouped_bf16(a, b, d, list(ks), ks_tensor, d if accumulate and c is None else c)


# ---------------------------------------------------------------- public API


def _no_psum(use_psum_layout: bool) -> None:
    if use_psum_layout:
        raise ValueError("use_psum_layout=True is not supported; pass per-row m_indices (the contiguous layout)")


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, recipe=None,
                                     compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False, **_upstream_only) -> torch.Tensor:
    """``d[r] = a[r] @ b[m_indices[r]]^T`` for rows with ``m_indices[r] >= 0``; ``a [M, k]``, ``b [G, n, k]``."""
    _no_psum(use_psum_layout)
    a, b = _check_contiguous_fp8(a, b, d, m_indices, "nk", recipe)
    _contiguous_op(list(a), list(b), d, m_indices)
    return d


def m_grouped_fp8_gemm_nn_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, recipe=None,
                                     compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False, **_upstream_only) -> torch.Tensor:
    """``d[r] = a[r] @ b[m_indices[r]]`` with ``b [G, k, n]`` (MoE dgrad: output grads times expert weights)."""
    _no_psum(use_psum_layout)
    a, b = _check_contiguous_fp8(a, b, d, m_indices, "kn", recipe)
    _contiguous_nn_op(list(a), list(b), d, m_indices)
    return d


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor,
                                      compiled_dims: str = "nk", use_psum_layout: bool = False,
                                      **_upstream_only) -> torch.Tensor:
    """bf16 twin of ``m_grouped_fp8_gemm_nt_contiguous``."""
    _no_psum(use_psum_layout)
    check_tensor("a", a, (torch.bfloat16,), (None, None))
    m, k = a.shape
    check_tensor("b", b, (torch.bfloat16,), (None, None, k))
    check_out(d, (m, b.shape[1]), None, dtypes=(torch.bfloat16,))
    check_m_indices(m_indices, m, b.shape[0])
    check_same_device(a=a, b=b, d=d, m_indices=m_indices)
    _contiguous_bf16_op(a, b, d, m_indices)
    return d


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                                 compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T``; ``a [G, m_max, k]``, ``b [G, n, k]``."""
    _check_masked_fp8(a, b, d, masked_m, expected_m)
    _masked_op([a[0], a[1]], [b[0], b[1]], d, masked_m, expected_m)
    return d


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                                  expected_m: int, compiled_dims: str = "nk") -> torch.Tensor:
    """bf16 twin of ``m_grouped_fp8_gemm_nt_masked``."""
    check_tensor("a", a, (torch.bfloat16,), (None, None, None))
    g, m_max, k = a.shape
    check_tensor("b", b, (torch.bfloat16,), (g, None, k))
    check_out(d, (g, m_max, b.shape[1]), None, dtypes=(torch.bfloat16,))
    _check_masked_m(masked_m, g, m_max, expected_m)
    check_same_device(a=a, b=b, d=d, masked_m=masked_m)
    _masked_bf16_op(a, b, d, masked_m, expected_m)
    return d


def k_grouped_fp8_gemm_tn_contiguous(a, b, d: torch.Tensor, ks: Sequence[int], ks_tensor: torch.Tensor | None = None,
                                     c: torch.Tensor | None = None, recipe=(1, 1, 128), compiled_dims: str = "mn",
                                     use_psum_layout: bool = False) -> torch.Tensor:
    """``d[g] = c[g] + a_g^T @ b_g`` with ``a = (fp8 [sum_k, m], sf [sum_k/128, m])``, ``b`` likewise with n.
    MXFP8: fp32 power-of-two ``sf [sum_k/32, m]`` (32x1 along the token dimension), or packed with
    ``recipe=(1, 1, 32)``.

    ``ks[g]`` (multiples of 128, on the host) are the groups' row counts; ``d`` and ``c`` are fp32 ``[G, m, n]``.
    """
    _no_psum(use_psum_layout)
    a, b = _check_k_grouped_fp8(a, b, d, ks, ks_tensor, c, recipe)
    _k_grouped_op(list(a), list(b), d, list(ks), ks_tensor, *_c_args(d, c))
    return d


def k_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, ks: Sequence[int], ks_tensor: torch.Tensor | None = None,
                                     c: torch.Tensor | None = None, recipe=(1, 1, 128), compiled_dims: str = "mn",
                                     use_psum_layout: bool = False) -> torch.Tensor:
    """DeepGEMM's SM90 weight-gradient layout: ``d[g] = c[g] + A_g @ B_g^T`` with K-major blocks packed flat.

    ``a[0]`` holds, for each group in turn, ``A_g`` as a row-major ``[m, ks[g]]`` block (so ``sum(ks) * m``
    values); ``a[1]`` is ``[m, sum(ks)/128]`` (1x128 along K); ``b`` likewise with n. Same result as
    ``k_grouped_fp8_gemm_tn_contiguous`` on the untransposed data.
    """
    _no_psum(use_psum_layout)
    _check_k_grouped_nt_fp8(a, b, d, ks, ks_tensor, c)
    _k_grouped_nt_op([a[0], a[1]], [b[0], b[1]], d, list(ks), ks_tensor, *_c_args(d, c))
    return d


def k_grouped_bf16_gemm_tn_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, ks: Sequence[int],
                                      ks_tensor: torch.Tensor | None = None, c: torch.Tensor | None = None,
                                      compiled_dims: str = "mn", use_psum_layout: bool = False) -> torch.Tensor:
    """bf16 twin of ``k_grouped_fp8_gemm_tn_contiguous`` (any group sizes)."""
    _no_psum(use_psum_layout)
    check_tensor("a", a, (torch.bfloat16,), (None, None))
    sum_k, m = a.shape
    check_tensor("b", b, (torch.bfloat16,), (sum_k, None))
    ks = _check_ks(ks, ks_tensor, sum_k, 1)
    check_out(d, (len(ks), m, b.shape[1]), c, dtypes=(torch.float32,))
    check_same_device(a=a, b=b, d=d, c=c)
    _k_grouped_bf16_op(a, b, d, list(ks), ks_tensor, *_c_args(d, c))
    return d


# DeepGEMM v1 and legacy names
m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_gemm_fp8_fp8_bf16_nt_masked = m_grouped_fp8_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked
