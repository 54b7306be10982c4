"""The lightning indexer's scores (DeepSeek-V3.2 DSA): ``fp8_mqa_logits``, ``fp8_paged_mqa_logits``, top-k.

``logits[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . k[s] * k_scale[s])``: FP8 e4m3 queries (64 heads of
128), one shared FP8 key per token with an fp32 per-token scale, fp32 head weights (the indexer's softmax
scale and any query scale folded in). DeepGEMM's names, shapes and masks:

* ``fp8_mqa_logits(q [s_q, h, d], (k [s_kv, d], k_scale [s_kv]), weights [s_q, h], ks [s_q], ke [s_q])``
  -> ``[s_q, s_kv]`` fp32, ``-inf`` outside ``[ks[t], ke[t])`` (prefill; ``ks``/``ke`` make it causal and
  keep packed sequences apart);
* ``fp8_paged_mqa_logits(q [b, next_n, h, d], kv_cache [blocks, block_size, 1, d + 4] uint8, weights
  [b * next_n, h], context_lens [b] (or [b, next_n]), block_table [b, max_blocks], schedule_metadata,
  max_model_len)`` -> ``[b * next_n, max_model_len]`` (decode; the cache block stores its ``block_size x d``
  e4m3 keys, then their ``block_size`` fp32 scales). Query ``j`` of ``next_n`` sees positions
  ``<= context_len - next_n + j`` (1-d lengths) or ``< context_lens[i, j]`` (2-d).

``select_topk`` turns logits into the ``indices`` the sparse attention consumes.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from accel.registry import Case, VerifySpec

LOGITS_OP = "deep_gemm.fp8_mqa_logits"
PAGED_OP = "deep_gemm.fp8_paged_mqa_logits"
E4M3_MAX = 448.0


def _fail(fn: str, msg: str) -> None:
    raise ValueError(f"{fn}: {msg}")


def _check_common(fn: str, q: torch.Tensor, weights: torch.Tensor, rows: int, heads: int) -> None:
    if q.dtype != torch.float8_e4m3fn:
        _fail(fn, f"q must be float8_e4m3fn, got {q.dtype}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, heads):
        _fail(fn, f"weights must be float32 [{rows}, {heads}], got {weights.dtype} {tuple(weights.shape)}")


def _check_logits(q, kv, weights, ks, ke) -> tuple[torch.Tensor, torch.Tensor]:
    fn = "fp8_mqa_logits"
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail(fn, f"q must be [s_q, heads, d], got {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        _fail(fn, "kv must be a pair (k float8_e4m3fn [s_kv, d], k_scale float32 [s_kv])")
    k, scale = kv
    s_q, heads, d = q.shape
    _check_common(fn, q, weights, s_q, heads)
    if k.dtype != torch.float8_e4m3fn or k.dim() != 2 or k.shape[1] != d:
        _fail(fn, f"kv[0] must be float8_e4m3fn [s_kv, {d}], got {k.dtype} {tuple(k.shape)}")
    scale = scale.reshape(-1) if scale.dim() == 2 and scale.shape[1] == 1 else scale
    if scale.dtype != torch.float32 or tuple(scale.shape) != (k.shape[0],):
        _fail(fn, f"kv[1] must be float32 [{k.shape[0]}] (one scale per key), got {scale.dtype} "
                  f"{tuple(kv[1].shape)}")
    for name, t in (("cu_seqlen_ks", ks), ("cu_seqlen_ke", ke)):
        if t.dtype != torch.int32 or tuple(t.shape) != (s_q,):
            _fail(fn, f"{name} must be int32 [{s_q}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("kv[0]", k), ("kv[1]", scale), ("weights", weights), ("cu_seqlen_ks", ks),
                    ("cu_seqlen_ke", ke)):
        if t.device != q.device:
            _fail(fn, f"{name} must be on q's device {q.device}, got {t.device}")
    return k, scale


@registry.reference_for(LOGITS_OP)
def fp8_mqa_logits_reference(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor,
                             cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, clean_logits: bool = True
                             ) -> torch.Tensor:
    """fp32 PyTorch, one head at a time (memory ``[s_q, s_kv]``, never ``[s_q, heads, s_kv]``)."""
    k, scale = kv[0].float() * kv[1].reshape(-1, 1), q.float()
    logits = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        logits += weights[:, h, None] * (scale[:, h] @ k.T).relu()
    cols = torch.arange(k.shape[0], device=q.device)
    inside = (cols[None, :] >= cu_seqlen_ks[:, None]) & (cols[None, :] < cu_seqlen_ke[:, None])
    return logits.masked_fill(~inside, -math.inf)


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor,
                   cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, clean_logits: bool = True
                   ) -> torch.Tensor:
    """Indexer logits ``[s_q, s_kv]`` fp32 (module docstring). ``clean_logits`` is accepted for DeepGEMM
    compatibility; both paths always write ``-inf`` outside ``[ks, ke)``, so it changes nothing."""
    k, scale = _check_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    return _fp8_mqa_logits_torch_op(q, [k, scale], weights, cu_seqlen_ks, cu_seqlen_ke)


def _check_paged(q, kv_cache, weights, context_lens, block_table, max_model_len) -> None:
    fn = "fp8_paged_mqa_logits"
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _fail(fn, f"q must be [batch, next_n, heads, d], got {tuple(getattr(q, 'shape', ()))}")
    b, next_n, heads, d = q.shape
    _check_common(fn, q, weights, b * next_n, heads)
    if kv_cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or kv_cache.dim() != 4 or kv_cache.shape[2] != 1 \
            or kv_cache.shape[3] != d + 4:
        _fail(fn, f"kv_cache must be uint8 [num_blocks, block_size, 1, {d + 4}], got {kv_cache.dtype} "
                  f"{tuple(kv_cache.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) not in ((b,), (b, next_n)):
        _fail(fn, f"context_lens must be int32 [{b}] or [{b}, {next_n}], got {context_lens.dtype} "
                  f"{tuple(context_lens.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        _fail(fn, f"block_table must be int32 [{b}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    if max_model_len < 1 or max_model_len > block_table.shape[1] * kv_cache.shape[1]:
        _fail(fn, f"max_model_len must be in [1, max_blocks * block_size = "
                  f"{block_table.shape[1] * kv_cache.shape[1]}], got {max_model_len}")
    for name, t in (("kv_cache", kv_cache), ("weights", weights), ("context_lens", context_lens),
                    ("block_table", block_table)):
        if t.device != q.device:
            _fail(fn, f"{name} must be on q's device {q.device}, got {t.device}")


def split_paged_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a ``[blocks, block_size, 1, d + 4]`` indexer cache: (e4m3 [blocks, block_size, d], fp32
    scales [blocks, block_size]). Each block holds its keys first, then their scales (DeepGEMM's layout)."""
    blocks, block_size, _, width = kv_cache.shape
    raw = kv_cache.view(torch.uint8).reshape(blocks, block_size * width)
    keys = raw[:, : block_size * (width - 4)].view(torch.float8_e4m3fn).view(blocks, block_size, width - 4)
    return keys, raw[:, block_size * (width - 4):].view(torch.float32)


def kv_cache_cast_to_fp8(k: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, 1, d]`` bf16/fp32 keys -> the ``uint8 [blocks, block_size, 1, d + 4]`` cache
    ``fp8_paged_mqa_logits`` reads: per token, scale = amax / 448 (floored at 1e-4 like DeepGEMM's test)."""
    if k.dim() != 4 or k.shape[2] != 1:
        raise ValueError(f"kv_cache_cast_to_fp8: k must be [num_blocks, block_size, 1, d], got {tuple(k.shape)}")
    blocks, block_size, _, d = k.shape
    scale = k.float().abs().amax(-1, keepdim=True).clamp_min(1e-4) / E4M3_MAX
    values = (k.float() / scale).to(torch.float8_e4m3fn)
    out = torch.empty(blocks, block_size * (d + 4), dtype=torch.uint8, device=k.device)
    out[:, : block_size * d] = values.reshape(blocks, block_size * d).view(torch.uint8)
    out[:, block_size * d:] = scale.reshape(blocks, block_size).view(torch.uint8)
    return out.view(blocks, block_size, 1, d + 4)


def paged_row_ends(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int32 ``[b * next_n]``: one past the last key position each query row sees."""
    if context_lens.dim() == 2:
        return context_lens.reshape(-1)
    offsets = torch.arange(next_n, device=context_lens.device, dtype=torch.int32) - next_n + 1
    return (context_lens[:, None] + offsets[None, :]).reshape(-1)


@registry.reference_for(PAGED_OP)
def fp8_paged_mqa_logits_reference(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                   context_lens: torch.Tensor, block_table: torch.Tensor,
                                   schedule_metadata: torch.Tensor | None, max_model_len: int,
                                   clean_logits: bool = True) -> torch.Tensor:
    """Gather each sequence's pages into a contiguous key list, then the prefill reference with ``ks = 0``."""
    b, next_n = q.shape[:2]
    keys, scales = split_paged_cache(kv_cache)
    ends = paged_row_ends(context_lens, next_n).clamp(0, max_model_len).view(b, next_n)
    rows = torch.full((b * next_n, max_model_len), -math.inf, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(ends[i].max())
        pages = block_table[i, : -(-n // keys.shape[1])].long()  # only the pages the row's keys live in
        k, s = keys[pages].reshape(-1, keys.shape[-1])[:n], scales[pages].reshape(-1)[:n]
        rows[i * next_n:(i + 1) * next_n, :n] = fp8_mqa_logits_reference.__wrapped__(
            q[i], (k, s), weights[i * next_n:(i + 1) * next_n], torch.zeros_like(ends[i]), ends[i])
    return rows


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor,
                         schedule_metadata: torch.Tensor | None, max_model_len: int, clean_logits: bool = True
                         ) -> torch.Tensor:
    """Indexer logits over a paged FP8 key cache, ``[b * next_n, max_model_len]`` fp32 (module docstring).

    ``schedule_metadata`` (DeepGEMM's ``get_paged_mqa_logits_metadata`` plan) is accepted and unused: the
    Triton kernel's grid is (query row, key tile), which needs no plan. Block-table entries past a row's last
    page are never read, so they may hold anything.
    """
    _check_paged(q, kv_cache, weights, context_lens, block_table, max_model_len)
    return _fp8_paged_mqa_logits_torch_op(q, kv_cache, weights, context_lens, block_table, schedule_metadata,
                                           max_model_len)


def select_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[s_q, topk]`` column indices of each row's ``topk`` largest logits, -1 for slots that would
    pick a ``-inf`` (masked) column or lie past ``s_kv``: the ``indices`` ``sparse_mla_attention`` and
    ``flash_mla_sparse_fwd`` consume.

    ``torch.topk`` (a radix select on CUDA) is the selection: a fused select over 2048 of 128K fp32 values
    per row is a project of its own; this wrapper only fixes the invalid-slot convention.
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"select_topk: logits must be a float [s_q, s_kv] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if topk < 1:
        raise ValueError(f"select_topk: topk must be >= 1, got {topk}")
    values, idx = logits.topk(min(topk, logits.shape[1]), dim=-1)
    idx = torch.where(values == -math.inf, -1, idx).to(torch.int32)
    return torch.nn.functional.pad(idx, (0, topk - idx.shape[1]), value=-1)


# ---- verification cases ------------------------------------------------------------------------------------------

def _fp8_inputs(s_q: int, heads: int, d: int, g: torch.Generator):
    """DeepGEMM's test inputs: q cast straight to e4m3, keys with a per-token amax scale, weights ~ N(0, 1)."""
    q = torch.randn(s_q, heads, d, generator=g).to(torch.float8_e4m3fn)
    return q, torch.randn(s_q, heads, generator=g)


def _make_logits_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator(device="cpu").manual_seed(seed)
    s_q, s_kv, heads, d = shape["s_q"], shape["s_kv"], shape["h"], shape.get("d", 128)
    q, weights = _fp8_inputs(s_q, heads, d, g)
    k = torch.randn(s_kv, d, generator=g)
    scale = k.abs().amax(-1).clamp_min(1e-4) / E4M3_MAX
    k8 = (k / scale[:, None]).to(torch.float8_e4m3fn)
    # causal rows of one packed batch of two sequences, the second starting at s_kv // 3
    t = torch.arange(s_q) * s_kv // max(s_q, 1)
    ks = torch.where(t >= s_kv // 3, s_kv // 3, 0).to(torch.int32)
    ke = (t + 1).to(torch.int32)
    return Case(args=tuple(x.to(device) if isinstance(x, torch.Tensor) else tuple(y.to(device) for y in x)
                           for x in (q, (k8, scale), weights, ks, ke)))


def _logits_flops(shape: dict) -> float:
    return 2.0 * shape["s_q"] * shape["s_kv"] / 2 * shape["h"] * shape.get("d", 128)  # causal half


fp8_mqa_logits_op = registry.register(
    LOGITS_OP,
    reference=fp8_mqa_logits_reference,
    triton="deep_gemm.kernels.mqa_logits:fp8_mqa_logits_triton",
    verify=VerifySpec(
        make_case=_make_logits_case,
        shapes=[dict(s_q=21, s_kv=70, h=4, d=32), dict(s_q=16, s_kv=40, h=16, d=128)],
        bench_shapes=[dict(s_q=4096, s_kv=s, h=64) for s in (8192, 32768)],
        # same e4m3 inputs: products exact, fp32 sums in another order (~1e-7 of the magnitude); a wrong mask,
        # head or scale moves the result by > 1e-2
        tolerance=1e-6,
        flops=_logits_flops,
        fp8=True,
    ),
)


def _make_paged_case(shape: dict, seed: int, device: torch.device) -> Case:
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, next_n, heads, d, block_size = shape["b"], shape["next_n"], shape["h"], shape.get("d", 128), shape["block"]
    lens = torch.randint(next_n, shape["max_len"] + 1, (b,), generator=g, dtype=torch.int32)
    max_blocks = -(-shape["max_len"] // block_size)
    num_blocks = b * max_blocks + 1
    q, weights = _fp8_inputs(b * next_n, heads, d, g)
    cache = kv_cache_cast_to_fp8(torch.randn(num_blocks, block_size, 1, d, generator=g))
    table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    return Case(args=(q.view(b, next_n, heads, d).to(device), cache.to(device), weights.to(device), lens.to(device),
                      table.to(device), None, shape["max_len"]))


def _paged_flops(shape: dict) -> float:
    return 2.0 * shape["b"] * shape["next_n"] * shape["max_len"] * shape["h"] * shape.get("d", 128)


fp8_paged_mqa_logits_op = registry.register(
    PAGED_OP,
    reference=fp8_paged_mqa_logits_reference,
    triton="deep_gemm.kernels.mqa_logits:fp8_paged_mqa_logits_triton",
    verify=VerifySpec(
        make_case=_make_paged_case,
        shapes=[dict(b=3, next_n=2, h=4, d=32, block=16, max_len=50)],
        bench_shapes=[dict(b=128, next_n=1, h=64, block=64, max_len=32768)],
        tolerance=1e-6,
        flops=_paged_flops,
        fp8=True,
    ),
)


# The torch ops (docs/custom_ops.md; no autograd: the indexer's logits only select rows). The paged reference walks
# each sequence's pages on the host (its length as a Python int), so that op is opaque, its fake allocating the
# logits.
@registry.torch_op(fp8_mqa_logits_op)
def _fp8_mqa_logits_torch_op(q: torch.Tensor, kv: list[torch.Tensor], weights: torch.Tensor,
                             cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                             clean_logits: bool = True) -> torch.Tensor:
    return fp8_mqa_logits_op(q, tuple(kv), weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)


def _paged_fake(q, kv_cache, weights, context_lens, block_table, schedule_metadata, max_model_len, clean_logits=True):
    return q.new_empty(q.shape[0] * q.shape[1], max_model_len, dtype=torch.float32)


@registry.torch_op(fp8_paged_mqa_logits_op, fake=_paged_fake, opaque=True)
def _fp8_paged_mqa_logits_torch_op(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                   context_lens: torch.Tensor, block_table: torch.Tensor,
                                   schedule_metadata: torch.Tensor | None, max_model_len: int,
                                   clean_logits: bool = True) -> torch.Tensor:
    return fp8_paged_mqa_logits_op(q, kv_cache, weights, context_lens, block_table, schedule_metadata,
                                   max_model_len, clean_logits)
