"""Dense GEMMs with DeepGEMM v2's names: ``fp8_gemm_{nt,nn,tn}`` and ``bf16_gemm_{nt,nn,tn}``.

``D = A @ B^T`` in the ``nt`` layout (A [m, k], B [n, k], both K-major). ``nn`` takes B as [k, n]
(the dgrad layout, ``dX = dY @ W``), ``tn`` takes A as [k, m] and B as [k, n] (the wgrad layout,
``dW = dY^T @ X``, reduction over the token dimension) and ``tt`` takes A as [k, m], B as [n, k].
Each layout is a strided view of the nt problem, so one Triton kernel serves all four
(``deep_gemm.kernels.gemm``).

FP8 scales: A per 1x128 tile along K (``[m, k/128]``; ``[k/128, m]`` for tn); B per 128x128
block (``[ceil(n/128), k/128]``) or per 1x128 tile (``[n, k/128]``), told apart by shape. MXFP8: both
per 1x32 along K with power-of-two scales (fp32 ``[m, k/32]``, or DeepGEMM's packed int32 with
``recipe=(1, 1, 32)``). Packed int32 UE8M0 scales without that recipe are 1x128 (DeepGEMM's SM100 format).
``fp8_gemm_*`` take ``(tensor, scales)`` pairs. Output: ``d`` (bf16 or fp32, written in place);
with ``c``, ``d = c + A @ B^T`` (``c`` may be ``d``).
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from deep_gemm import reference
from deep_gemm.utils import (
    BLOCK,
    FP8,
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

_LAYOUTS = {"nt": ("mk", "nk"), "nn": ("mk", "kn"), "tn": ("km", "kn"), "tt": ("km", "nk")}


def _dims(kind: str, a: torch.Tensor, b: torch.Tensor, names=("a", "b")) -> tuple[int, int, int]:
    la, lb = _LAYOUTS[kind]
    dims = dict(zip(la, a.shape))
    b_dims = dict(zip(lb, b.shape))
    if b_dims["k"] != dims["k"]:
        raise ValueError(f"{names[1]} must be [{', '.join(lb)}] with k = {dims['k']} (from {names[0]}), "
                         f"got {list(b.shape)}: A and B disagree on K")
    return dims["m"], b_dims["n"], dims["k"]


def _scale_shapes(letters: str, m_or_n: int, k: int, per_block_allowed: bool) -> list[tuple[int, ...]]:
    row_counts = [m_or_n] + ([ceil_div(m_or_n, BLOCK)] if per_block_allowed else [])
    return [tuple(r if ch != "k" else k // BLOCK for ch in letters) for r in row_counts]


def check_fp8_args(kind: str, a, b, d, c, recipe=None) -> tuple[tuple, tuple]:
    """Validate a dense FP8 call; return its (fp8, scales) pairs with the scales in the kernels' form
    (``utils.kernel_scales``: fp32 per 128 of K, or packed UE8M0 per 32 for MXFP8)."""
    a_t, sfa = unpack_pair("a", a)
    b_t, sfb = unpack_pair("b", b)
    la, lb = _LAYOUTS[kind]
    check_tensor("a[0]", a_t, (FP8,), (None, None))
    check_tensor("b[0]", b_t, (FP8,), (None, None))
    m, n, k = _dims(kind, a_t, b_t, ("a[0]", "b[0]"))
    check_k("a[0]", k)
    gran_k = recipe_gran_k(recipe)
    sfa, a_mx = kernel_scales("a[1] (scales of a)", sfa, k, la.index("k") - 2, gran_k)
    sfb, b_mx = kernel_scales("b[1] (scales of b)", sfb, k, lb.index("k") - 2, gran_k)
    check_scale("a[1] (scales of a)", sfa, _scale_shapes(la, m, k, per_block_allowed=False))
    check_scale("b[1] (scales of b)", sfb, _scale_shapes(lb, n, k, per_block_allowed=True))
    check_mx_pair(a_mx, b_mx, sfb.shape[1 - lb.index("k")], n)
    check_out(d, (m, n), c)
    check_same_device(a=a_t, sfa=sfa, b=b_t, sfb=sfb, d=d, c=c)
    return (a_t, sfa), (b_t, sfb)


def check_bf16_args(kind: str, a, b, d, c) -> None:
    check_tensor("a", a, (torch.bfloat16,), (None, None))
    check_tensor("b", b, (torch.bfloat16,), (None, None))
    m, n, _ = _dims(kind, a, b)
    check_out(d, (m, n), c)
    check_same_device(a=a, b=b, d=d, c=c)


# ---------------------------------------------------------------- verification cases


def _store(x: torch.Tensor, letters: str) -> torch.Tensor:
    """Lay a logical [rows, k] matrix out as ``letters`` says (k-major or transposed)."""
    return x.contiguous() if letters[1] == "k" else x.T.contiguous()


def quantize_operand(x: torch.Tensor, letters: str, per_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 operand in the layout ``letters`` from a logical ``[rows, k]`` matrix, scales along k."""
    stored = _store(x, letters)
    if letters[1] == "k":
        return reference.cast_tiles(stored, BLOCK if per_block else 1, BLOCK)
    return reference.cast_tiles(stored, BLOCK, BLOCK if per_block else 1)


def make_dense_case(kind: str, fp8: bool):
    la, lb = _LAYOUTS[kind]

    def make(shape: dict, seed: int, device: torch.device) -> Case:
        gen = torch.Generator().manual_seed(seed)
        m, n, k = shape["m"], shape["n"], shape["k"]
        a = torch.randn(m, k, generator=gen, dtype=torch.float32)
        b = torch.randn(n, k, generator=gen, dtype=torch.float32)
        out_dtype = torch.float32 if shape.get("accumulate") else torch.bfloat16
        d = torch.empty(m, n, dtype=out_dtype, device=device)
        c = (torch.randn(m, n, generator=gen) * 4).to(device) if shape.get("accumulate") else None
        if fp8:
            a_op = tuple(t.to(device) for t in quantize_operand(a, la, per_block=False))
            b_op = tuple(t.to(device) for t in quantize_operand(b, lb, per_block=kind != "tn"))
        else:
            a_op = _store(a, la).to(device=device, dtype=torch.bfloat16)
            b_op = _store(b, lb).to(device=device, dtype=torch.bfloat16)
        return Case(args=(a_op, b_op, d, c), outputs=(2,))

    return make


# M in {1, 64, 129, 256}, N and K multiples of 128 up to 256: what the CPU interpreter can run.
TEST_SHAPES = [
    {"m": 1, "n": 128, "k": 256}, {"m": 64, "n": 256, "k": 128}, {"m": 129, "n": 128, "k": 256},
    {"m": 256, "n": 256, "k": 256, "accumulate": True},
]
# DeepSeek-V3's dense GEMM shapes (DeepGEMM's README table).
NK_SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
BENCH_SHAPES = [{"m": m, "n": n, "k": k} for m in (64, 128, 4096) for n, k in NK_SHAPES]


def dense_flops(s: dict) -> float:
    return 2.0 * s["m"] * s["n"] * s["k"]


def _dense_bytes(fp8: bool):
    def count(s: dict) -> float:
        elem = 1 if fp8 else 2
        return float((s["m"] * s["k"] + s["n"] * s["k"]) * elem + s["m"] * s["n"] * 2)

    return count


# The other layouts and the bf16 twins: the large-M training shapes only (keeps the GPU check short).
TRAINING_BENCH_SHAPES = [{"m": 4096, "n": n, "k": k} for n, k in NK_SHAPES[3:]]


# The PyTorch work of the dense wrapper (deep_gemm.kernels.gemm.gemm) outside its kernel, declared for
# verifier.fallback's gate.
TRITON_ALLOW = {
    "aten.copy_": "d = c + A @ B with c distinct from d: c is copied into d and the kernel accumulates onto it "
                  "(DeepGEMM's in-place contract); split-K copies its fp32 partial sums into d",
    "aten._to_copy": "split-K with c: the fp32 workspace the K slices add into starts as d (holding c)",
}


def _spec(kind: str, fp8: bool) -> VerifySpec:
    # 1e-5 calc_diff: kernel and reference see the same FP8 inputs and differ only in fp32
    # summation order and the final bf16 rounding of D.
    bench = BENCH_SHAPES if (kind, fp8) == ("nt", True) else TRAINING_BENCH_SHAPES
    return VerifySpec(make_case=make_dense_case(kind, fp8), shapes=TEST_SHAPES, bench_shapes=bench,
                      tolerance=1e-5, flops=dense_flops, bytes_moved=_dense_bytes(fp8), allow=TRITON_ALLOW)


_REFS = {
    ("nt", True): reference.fp8_gemm_nt_reference, ("nn", True): reference.fp8_gemm_nn_reference,
    ("tn", True): reference.fp8_gemm_tn_reference, ("tt", True): reference.fp8_gemm_tt_reference,
    ("nt", False): reference.bf16_gemm_nt_reference, ("nn", False): reference.bf16_gemm_nn_reference,
    ("tn", False): reference.bf16_gemm_tn_reference, ("tt", False): reference.bf16_gemm_tt_reference,
}
_OPS = {
    (kind, fp8): registry.register(f"deep_gemm.{'fp8' if fp8 else 'bf16'}_gemm_{kind}", reference=ref,
                                   triton=f"deep_gemm.kernels.gemm:gemm_{kind}", verify=_spec(kind, fp8))
    for (kind, fp8), ref in _REFS.items()
}


def _torch_op(kind: str, fp8: bool):
    """``dsv3::{fp8,bf16}_gemm_{kind}`` (docs/custom_ops.md): ``d`` written in place; an FP8 operand is its
    ``[values, scales]`` list. ``accumulate`` without ``c`` means ``c is d`` (a mutated argument may not alias
    another argument). No autograd: the training layers (``deep_gemm.linear``) own the backward."""
    kernel = _OPS[kind, fp8]
    if fp8:
        def body(a: list[torch.Tensor], b: list[torch.Tensor], d: torch.Tensor, c: torch.Tensor | None = None,
                 accumulate: bool = False) -> None:
            kernel(tuple(a), tuple(b), d, d if accumulate and c is None else c)
    else:
        def body(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 accumulate: bool = False) -> None:
            kernel(a, b, d, d if accumulate and c is None else c)
    return registry.torch_op(kernel, mutates_args=("d",))(body)


TORCH_OPS = {key: _torch_op(*key) for key in _OPS}


def _c_args(d: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """``(c, accumulate)`` for an op: ``c`` that is ``d`` travels as ``accumulate=True`` alone."""
    return (None, True) if c is d else (c, c is not None)


def _fp8(kind: str, a, b, d: torch.Tensor, c: torch.Tensor | None, recipe) -> torch.Tensor:
    a, b = check_fp8_args(kind, a, b, d, c, recipe)
    TORCH_OPS[kind, True](list(a), list(b), d, *_c_args(d, c))
    return d


def _bf16(kind: str, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    check_bf16_args(kind, a, b, d, c)
    TORCH_OPS[kind, False](a, b, d, *_c_args(d, c))
    return d


# ---------------------------------------------------------------- public API


def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, compiled_dims: str = "nk",
                disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """``d = a @ b^T (+ c)``; ``a = (fp8 [m, k], sf [m, k/128])``, ``b = (fp8 [n, k], sf [ceil(n/128) or n, k/128])``.

    Scales: fp32 (1x128 / 128x128, or MXFP8's power-of-two 1x32 ``[m, k/32]`` / ``[n, k/32]``) or DeepGEMM's
    packed UE8M0 int32 (1x128, or 1x32 with ``recipe=(1, 1, 32)``). ``compiled_dims`` and ``disable_ue8m0_cast``
    are accepted for DeepGEMM compatibility (fp32 scales are used as they are, never cast). Returns ``d``.
    """
    return _fp8("nt", a, b, d, c, recipe)


def fp8_gemm_nn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, compiled_dims: str = "nk",
                disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """``d = a @ b (+ c)``; ``a = (fp8 [m, k], sf [m, k/128])``, ``b = (fp8 [k, n], sf [k/128, ceil(n/128) or n])``."""
    return _fp8("nn", a, b, d, c, recipe)


def fp8_gemm_tn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, compiled_dims: str = "mn",
                disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """``d = a^T @ b (+ c)`` with ``a = (fp8 [k, m], sf [k/128, m])``, ``b = (fp8 [k, n], sf [k/128, n])``."""
    return _fp8("tn", a, b, d, c, recipe)


def fp8_gemm_tt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, compiled_dims: str = "mn",
                disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """``d = a^T @ b^T (+ c)``; ``a = (fp8 [k, m], sf [k/128, m])``, ``b`` as in ``fp8_gemm_nt``."""
    return _fp8("tt", a, b, d, c, recipe)


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 compiled_dims: str = "nk") -> torch.Tensor:
    """``d = a @ b^T (+ c)`` in bf16 with fp32 accumulation; ``a [m, k]``, ``b [n, k]``."""
    return _bf16("nt", a, b, d, c)


def bf16_gemm_nn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 compiled_dims: str = "nk") -> torch.Tensor:
    """``d = a @ b (+ c)``; ``a [m, k]``, ``b [k, n]``."""
    return _bf16("nn", a, b, d, c)


def bf16_gemm_tn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 compiled_dims: str = "mn") -> torch.Tensor:
    """``d = a^T @ b (+ c)``; ``a [k, m]``, ``b [k, n]``."""
    return _bf16("tn", a, b, d, c)


def bf16_gemm_tt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None,
                 compiled_dims: str = "mn") -> torch.Tensor:
    """``d = a^T @ b^T (+ c)``; ``a [k, m]``, ``b [n, k]``."""
    return _bf16("tt", a, b, d, c)


# DeepGEMM v1 name
gemm_fp8_fp8_bf16_nt = fp8_gemm_nt
