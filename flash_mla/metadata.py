"""The split-KV work plan (``get_mla_metadata``) and the check that a plan fits the seqlens it is used with.

Flash-decoding splits each sequence's KV blocks into chunks so that a small batch of long
sequences still fills every SM; a combine step merges the partial results. The plan is computed
once per decode step on the host and reused by every layer, as FlashMLA's is.

``tile_scheduler_metadata`` is int32 ``[num_parts + batch, 6]``, one row per chunk:
``(batch, first_block, end_block, partial_slot, seqlen, splits_of_batch)``, padded with ``PAD_ROW``.
Its size depends only on the device and the batch size (at most ``num_parts + batch`` chunks are
ever planned), so a plan for new lengths can be copied into a buffer a device graph captured, as
with FlashMLA's fixed-size metadata. The seqlen column is the fingerprint that lets
``flash_mla_with_kvcache`` reject a plan made for other lengths.
``num_splits`` is int32 ``[batch + 1]``, the prefix sum of chunks per sequence (FlashMLA's meaning).
"""

from __future__ import annotations

import weakref

import torch

import accel

BLOCK_SIZE = 64  # tokens per KV-cache page, fixed by FlashMLA's format
META_COLS = 6
_BLOCK_OVERHEAD = 5  # a chunk's fixed cost (launch, Q load, combine) in units of one 64-token block
_CPU_PARTS = 8  # work parts without a GPU: enough to exercise several splits under the interpreter
_ROWS_PER_TILE = 64  # query rows one program handles at most (heads x s_q sharing a KV head)
PAD_ROW = (-1, 0, 0, -1, -1, 0)  # an unused work item (splits 0): the kernel returns at once


def _num_parts(device: torch.device, num_heads_k: int, rows: int) -> int:
    mod = accel.device_module()
    sms = _CPU_PARTS if device.type == "cpu" or mod is None else mod.get_device_properties(device).multi_processor_count
    return max(1, sms // (num_heads_k * -(-rows // _ROWS_PER_TILE)))


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_heads_q: int | None = None, is_fp8_kvcache: bool = False,
                     topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV plan for one decode step: ``(tile_scheduler_metadata, num_splits)``.

    ``num_q_tokens_per_head_k`` is ``s_q * h_q // h_kv`` (query rows sharing one KV head).
    ``num_heads_q`` and ``is_fp8_kvcache`` are accepted for FlashMLA compatibility; the plan does not
    depend on them. ``topk`` (sparse attention) is not supported.
    """
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1:
        raise ValueError(f"get_mla_metadata: cache_seqlens must be an int32 [batch] tensor, got "
                         f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens))} "
                         f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    if num_q_tokens_per_head_k < 1 or num_heads_k < 1:
        raise ValueError(f"get_mla_metadata: num_q_tokens_per_head_k and num_heads_k must be >= 1, got "
                         f"{num_q_tokens_per_head_k} and {num_heads_k}")
    if num_heads_q is not None and num_heads_q % num_heads_k:
        raise ValueError(f"get_mla_metadata: num_heads_q={num_heads_q} must be a multiple of num_heads_k={num_heads_k}")
    if topk is not None:
        raise ValueError(f"get_mla_metadata: topk={topk} (sparse attention) is not supported; expected None")
    seqlens = cache_seqlens.tolist()
    if seqlens and min(seqlens) < 0:
        raise ValueError(f"get_mla_metadata: cache_seqlens must be >= 0, got {seqlens}")
    blocks = [-(-n // BLOCK_SIZE) for n in seqlens]
    parts = _num_parts(cache_seqlens.device, num_heads_k, num_q_tokens_per_head_k)
    payload = max(1, -(-(sum(blocks) + _BLOCK_OVERHEAD * len(blocks)) // parts))
    rows, prefix = [], [0]
    for batch, (n, nblk) in enumerate(zip(seqlens, blocks)):
        splits = -(-nblk // payload)
        for i in range(splits):
            rows.append((batch, nblk * i // splits, nblk * (i + 1) // splits, prefix[-1] + i, n, splits))
        prefix.append(prefix[-1] + splits)
    rows += [PAD_ROW] * (parts + len(seqlens) - len(rows))  # fixed size: a captured graph can replay new plans
    meta = torch.tensor(rows, dtype=torch.int32).reshape(-1, META_COLS).to(cache_seqlens.device)
    return meta, torch.tensor(prefix, dtype=torch.int32, device=cache_seqlens.device)


def check_metadata(tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor, cache_seqlens: torch.Tensor,
                   block_table: torch.Tensor, num_blocks: int) -> None:
    """Raise ValueError unless the plan was made for ``cache_seqlens`` and every block it reads exists.

    Needs one host sync, so the verdict is remembered on the metadata tensor for as long as none of
    the tensors involved is modified (every layer of a decode step then pays nothing); under
    ``torch.inference_mode`` (no version counters) it runs on every call. Skipped while a device
    graph is being captured, where a sync is not allowed.
    """
    meta, batch = tile_scheduler_metadata, cache_seqlens.shape[0]
    if meta.dtype != torch.int32 or meta.dim() != 2 or meta.shape[1] != META_COLS:
        raise ValueError(f"tile_scheduler_metadata must be int32 [work_items, {META_COLS}] from get_mla_metadata, got "
                         f"{meta.dtype} {tuple(meta.shape)}")
    if num_splits.dtype != torch.int32 or tuple(num_splits.shape) != (batch + 1,):
        raise ValueError(f"num_splits must be int32 [{batch + 1}] (batch + 1), got {num_splits.dtype} "
                         f"{tuple(num_splits.shape)}")
    mod = accel.device_module()
    if mod is not None and getattr(mod, "is_current_stream_capturing", lambda: False)():
        return  # no host sync inside CUDA/MUSA graph capture: validate with an eager call before capturing
    tensors = (meta, cache_seqlens, block_table, num_splits)
    # inference tensors (torch.inference_mode) have no version counter: check them on every call
    remember = not any(t.is_inference() for t in tensors)
    if remember:
        key = tuple((weakref.ref(t), t._version) for t in tensors[1:])
        cached = getattr(meta, "_flash_mla_checked", None)
        if cached is not None and cached[0] == meta._version and all(
            a[0]() is b[0]() and a[1] == b[1] for a, b in zip(cached[1], key)
        ):
            return
    seqlens, table = cache_seqlens.tolist(), block_table.tolist()
    plan, prefix = meta.tolist(), num_splits.tolist()
    max_blocks = block_table.shape[1]
    for b, n in enumerate(seqlens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}]={n}; expected >= 0")
        if n > max_blocks * BLOCK_SIZE:
            raise ValueError(f"cache_seqlens[{b}]={n} needs {-(-n // BLOCK_SIZE)} blocks but block_table has "
                             f"{max_blocks} columns (expected seqlen <= {max_blocks * BLOCK_SIZE})")
        used = table[b][: -(-n // BLOCK_SIZE)]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            raise ValueError(f"block_table[{b}] holds block ids {used}; expected ids in [0, {num_blocks})")
    covered = [0] * batch
    for row in plan:
        b, first, end, slot, n, splits = row
        if tuple(row) == PAD_ROW:
            continue
        if not 0 <= b < batch or n != seqlens[b] or not prefix[b] <= slot < prefix[b + 1] or splits != (
            prefix[b + 1] - prefix[b]
        ) or not 0 <= first < end:
            raise ValueError(f"tile_scheduler_metadata row {row} does not match cache_seqlens={seqlens} / "
                             f"num_splits={prefix}; expected the metadata get_mla_metadata returns for these seqlens")
        covered[b] += end - first
    expected = [-(-n // BLOCK_SIZE) for n in seqlens]
    if covered != expected or prefix[0] != 0:
        raise ValueError(f"tile_scheduler_metadata covers {covered} blocks per sequence but cache_seqlens={seqlens} "
                         f"needs {expected}; expected the metadata get_mla_metadata returns for these seqlens")
    if remember:
        meta._flash_mla_checked = (meta._version, key)
