"""flash_mla rejects bad input with a ValueError that names the argument and the expected value."""

import pytest
import torch

import flash_mla
from flash_mla.decode import make_paged_case


def _inputs(seqlens=(100, 30), s_q=1, h_q=4):
    g = torch.Generator().manual_seed(0)
    q, cache, table, lens = make_paged_case(len(seqlens), s_q, h_q, 1, list(seqlens), False, g, "cpu")
    meta, splits = flash_mla.get_mla_metadata(lens, s_q * h_q, 1)
    return dict(q=q, k_cache=cache, block_table=table, cache_seqlens=lens, head_dim_v=512,
                tile_scheduler_metadata=meta, num_splits=splits)


def test_valid_inputs_pass():
    out, lse = flash_mla.flash_mla_with_kvcache(**_inputs())
    assert out.shape == (2, 1, 4, 512) and lse.shape == (2, 4, 1)


def _other_seqlens_metadata():
    args = _inputs()
    args["tile_scheduler_metadata"], args["num_splits"] = flash_mla.get_mla_metadata(
        torch.tensor([30, 100], dtype=torch.int32), 4, 1)
    return args


def _same_blocks_other_length():
    args = _inputs()  # 100 and 30 tokens need 2 and 1 blocks; 70 and 10 need the same blocks
    args["tile_scheduler_metadata"], args["num_splits"] = flash_mla.get_mla_metadata(
        torch.tensor([70, 10], dtype=torch.int32), 4, 1)
    return args


def _edit(**changes):
    def build():
        args = _inputs()
        for key, fn in changes.items():
            args[key] = fn(args[key])
        return args
    return build


BAD = {
    "head dim 512": (_edit(q=lambda q: q[..., :512].contiguous()), "head dim"),
    "block size 32": (_edit(k_cache=lambda c: c.reshape(-1, 32, 1, 576)), "block size must be 64"),
    "q float64": (_edit(q=lambda q: q.double()), "bfloat16, float16 or float32"),
    "q float32, cache bf16": (_edit(q=lambda q: q.float()), "k_cache must have q's dtype"),
    "cache dtype": (_edit(k_cache=lambda c: c.half()), "k_cache must have q's dtype"),
    "block_table int64": (_edit(block_table=lambda t: t.long()), "block_table must be int32"),
    "seqlens int64": (_edit(cache_seqlens=lambda s: s.long()), "cache_seqlens must be int32"),
    "seqlen beyond table": (_edit(cache_seqlens=lambda s: torch.tensor([100, 500], dtype=torch.int32)),
                            "expected seqlen <= 192"),
    "negative seqlen": (_edit(cache_seqlens=lambda s: torch.tensor([100, -1], dtype=torch.int32)), "expected >= 0"),
    "metadata for other seqlens": (_other_seqlens_metadata, "get_mla_metadata returns for these seqlens"),
    "metadata for other lengths": (_same_blocks_other_length, "get_mla_metadata returns for these seqlens"),
    "num_splits shape": (_edit(num_splits=lambda s: s[:-1]), "num_splits must be int32 [3]"),
    "head_dim_v": (_edit(head_dim_v=lambda v: 600), "head_dim_v must be in [1, 576]"),
    "block id out of range": (_edit(block_table=lambda t: t.fill_(10**6)), "expected ids in [0,"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_decode_input(name):
    build, message = BAD[name]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        flash_mla.flash_mla_with_kvcache(**build())


def test_bad_decode_options():
    args = _inputs()
    b, s_q = args["q"].shape[:2]
    with pytest.raises(ValueError, match=r"indices must be int32 \[2, "):  # sparse decoding: checked, not ignored
        flash_mla.flash_mla_with_kvcache(**args, indices=torch.zeros(b, s_q, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="causal must be False with indices"):
        flash_mla.flash_mla_with_kvcache(**{**args, "causal": True}, indices=torch.zeros(b, s_q, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="FP8 k_cache must be float8_e4m3fn/uint8 with last dim 656"):
        flash_mla.flash_mla_with_kvcache(**args, is_fp8_kvcache=True)
    two_kv_heads = args["k_cache"].repeat(1, 1, 2, 1)
    with pytest.raises(ValueError, match="h_q=3 must be a multiple of the cache's h_kv=2"):
        flash_mla.flash_mla_with_kvcache(**{**args, "q": args["q"][:, :, :3], "k_cache": two_kv_heads})


def test_bad_metadata_input():
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        flash_mla.get_mla_metadata(torch.tensor([3, -2], dtype=torch.int32), 16, 1)
    with pytest.raises(ValueError, match="int32"):
        flash_mla.get_mla_metadata(torch.tensor([3, 2]), 16, 1)
    with pytest.raises(ValueError, match="topk"):
        flash_mla.get_mla_metadata(torch.tensor([3], dtype=torch.int32), 16, 1, topk=64)


def test_metadata_check_is_remembered_until_inputs_change():
    args = _inputs()
    flash_mla.flash_mla_with_kvcache(**args)
    assert hasattr(args["tile_scheduler_metadata"], "_flash_mla_checked")
    args["cache_seqlens"][1] = 2000  # in-place edit bumps the version: must be re-checked and rejected
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\]=2000"):
        flash_mla.flash_mla_with_kvcache(**args)


ATT_BAD = {
    "k shape": (lambda q, k, v: (q, k[:, :3], v, {}), "k must have q's shape"),
    "v batch": (lambda q, k, v: (q, k, v[:1], {}), "v must have shape"),
    "dtype": (lambda q, k, v: (q, k.double(), v, {}), "float32, float16 or bfloat16"),
    "layout": (lambda q, k, v: (q[0], k[0], v[0], {}), r"\[batch, seq, heads, d\]"),
    "cu int64": (lambda q, k, v: (q[0], k[0], v[0], {"cu_seqlens": torch.tensor([0, 4])}), "int32"),
    "cu total": (lambda q, k, v: (q[0], k[0], v[0], {"cu_seqlens": torch.tensor([0, 3], dtype=torch.int32)}),
                 "total=4"),
    "max_seqlen": (lambda q, k, v: (q[0], k[0], v[0],
                                    {"cu_seqlens": torch.tensor([0, 4], dtype=torch.int32), "max_seqlen": 2}),
                   "longest sequence has 4"),
}


@pytest.mark.parametrize("name", list(ATT_BAD))
def test_bad_attention_input(name):
    build, message = ATT_BAD[name]
    q, k, v = torch.randn(2, 4, 2, 24), torch.randn(2, 4, 2, 24), torch.randn(2, 4, 2, 16)
    q, k, v, kwargs = build(q, k, v)
    with pytest.raises(ValueError, match=message):
        flash_mla.mla_attention(q, k, v, **kwargs)


def test_inference_mode_checks_every_call():
    """Inference tensors have no version counter, so nothing is remembered and edits are still caught."""
    with torch.inference_mode():
        args = _inputs()
        out, _ = flash_mla.flash_mla_with_kvcache(**args)
        assert out.shape == (2, 1, 4, 512)
        args["cache_seqlens"][1] = 2000
        with pytest.raises(ValueError, match="cache_seqlens\\[1\\]=2000"):
            flash_mla.flash_mla_with_kvcache(**args)
