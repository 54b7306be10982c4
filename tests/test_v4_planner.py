"""DeepSeek-V4 in the memory model and the planner: parameter counts against the meta model and DeepSeek's published
sizes, FLOPs per token against an independent float64 count from the config and against DeepSeek's published
long-context ratio, the measured pieces' 4-stream residual, the V4-Flash config's dry run on H800 and H200."""

from __future__ import annotations

import json

import pytest
import torch

from models.deepseek_v3 import ModelArgs as V3Args
from models.deepseek_v4 import ModelArgs, Transformer
from planner import costs_v4
from planner import memory_measure as measure
from planner.memory import estimate
from planner.search import Layout, Request, evaluate
from planner.system import load_system
from recipes import train
from training.config import load_config

FLASH = "recipes/configs/deepseek_v4_flash.toml"


def _meta_counts(args: ModelArgs) -> tuple[int, int]:
    """(main model, MTP) parameters of the V4 model built on meta."""
    with torch.device("meta"):
        model = Transformer(args)
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    return sum(p.numel() for p in model.parameters()) - mtp, mtp


# (published total, its rounding unit, published activated, its unit): DeepSeek's 284B / 13B and 1.6T / 49B
PUBLISHED = {"deepseek_v4_flash": (284e9, 1e9, 13e9, 1e9), "deepseek_v4_pro": (1.6e12, 0.1e12, 49e9, 1e9)}


@pytest.mark.parametrize("name", ["deepseek_v4_flash", "deepseek_v4_pro", "debug_v4"])
def test_param_counts_equal_the_model_and_the_published_sizes(name):
    """The closed form counts every parameter of the meta model, exactly; V4-Flash and V4-Pro round to DeepSeek's
    published sizes (within half the published figure's last digit)."""
    args = ModelArgs.preset(name)
    main, mtp = _meta_counts(args)
    counts, with_mtp = args.param_counts(), args.param_counts(include_mtp=True)
    assert counts["total"] == main and with_mtp["total"] == main + mtp
    if name in PUBLISHED:
        total, unit, active, active_unit = PUBLISHED[name]
        assert abs(counts["total"] - total) <= unit / 2, counts
        assert abs(counts["activated"] - active) <= active_unit / 2, counts


def _keys(t: int, window: int, ratio: int, topk: int) -> tuple[int, int]:
    """(window keys, compressed entries) query ``t`` attends: integers, one query at a time."""
    closed = (t + 1) // ratio if ratio else 0
    return min(t + 1, window), (min(closed, topk) if ratio == 4 else closed)


def _reference_flops(args: ModelArgs, seq: int, position: int | None) -> float:
    """Forward FLOPs of one token, in float64, from the config: 2 x every GEMM'd parameter a token uses (the
    activated count less the vectors no GEMM multiplies: norm weights, sinks, position biases, mHC biases and
    scales), the attention core 4 h d per key, the indexer 2 H_I D_I per visible entry, the compressors' pool 2 per
    projected value, mHC (Sinkhorn 4 hc^2 per iteration, collapse 2 hc dim, spread and mix 2 hc dim + 2 hc^2 dim;
    the head's collapse 2 hc dim). Positions one by one (``position`` None: the mean over the sequence)."""
    d, h, hd, hc = args.dim, args.n_heads, args.head_dim, args.hc_mult
    mix = (2 + hc) * hc
    vectors = d + 1 + hc  # final norm, hc_head scale and base
    flops = 2.0 * hc * d  # hc_head's collapse
    positions = range(seq) if position is None else [position]
    for i in range(args.n_layers):
        ratio = args.compress_ratios[i]
        vectors += 2 * d + args.q_lora_rank + hd + h + 2 * (mix + 3)  # norms, sink, mHC
        coff = 2 if ratio == 4 else 1
        if ratio:
            vectors += ratio * coff * hd + hd  # ape, norm
            flops += 2.0 * coff * hd
        if ratio == 4:
            vectors += 4 * 2 * args.index_head_dim + args.index_head_dim
            flops += 2.0 * 2 * args.index_head_dim
        flops += 2 * (4.0 * hc * hc * args.hc_sinkhorn_iters + 2.0 * hc * d + 2.0 * (hc * d + hc * hc * d))
        per_query = 0.0
        for t in positions:
            window, entries = _keys(t, args.window_size, ratio, args.index_topk)
            per_query += 4.0 * h * hd * (window + entries)
            if ratio == 4:
                per_query += 2.0 * args.index_n_heads * args.index_head_dim * ((t + 1) // 4)
        flops += per_query / len(positions)
    return flops + 2.0 * (args.param_counts()["activated"] - vectors)


@pytest.mark.parametrize("name,seq,position", [("debug_v4", 300, None), ("debug_v4", 1024, 700),
                                               ("deepseek_v4_flash", 4096, None),
                                               ("deepseek_v4_flash", 65536, 65535)])
def test_flops_per_token_equal_a_float64_count_from_the_config(name, seq, position):
    """``costs_v4`` (op by op, from the shapes) against the count above (from the parameter counts, positions one
    by one); both in float64, so they agree to summation order (1e-12)."""
    args = ModelArgs.preset(name)
    ours = costs_v4.flops_per_token(args, seq, position)
    ref = _reference_flops(args, seq, position)
    assert ours == pytest.approx(ref, rel=1e-12)


def test_long_context_flops_against_deepseeks_published_ratio():
    """DeepSeek (V4 model card): at a 1M-token context one token costs V4-Flash 10% and V4-Pro 27% of V3.2's
    FLOPs. V3.2's count: 2 x activated parameters, the absorbed sparse core over its top-2048 latents
    (2 k h (576 + 512)) and the indexer over every earlier key (2 x 64 x 128 each), per layer. Within 3 points: the
    published figures are rounded to a percent and our presets' CSA / HCA layer schedules are assumptions
    (docs/v4.md; swapping one CSA layer of Flash for HCA moves its ratio by about half a point)."""
    p = 2**20
    v32 = V3Args.preset("deepseek_v32_671b")
    latent = v32.kv_lora_rank + v32.qk_rope_head_dim
    per_layer = (2.0 * v32.index_topk * v32.n_heads * (latent + v32.kv_lora_rank)
                 + 2.0 * p * v32.index_n_heads * v32.index_head_dim)
    ref = 2.0 * v32.param_counts()["activated"] + v32.n_layers * per_layer
    for name, published in (("deepseek_v4_flash", 0.10), ("deepseek_v4_pro", 0.27)):
        ratio = costs_v4.flops_per_token(ModelArgs.preset(name), p, position=p - 1) / ref
        assert abs(ratio - published) <= 0.03, (name, ratio)


@pytest.mark.parametrize("layer_id", [0, 1, 2, 4])  # window, CSA, HCA, the MTP block
def test_a_recomputed_block_keeps_its_four_streams(layer_id):
    """Whole-block recompute keeps exactly the block's input: ``hc_mult`` (4) hidden states per token (plus the
    next tokens' embeddings for the MTP block), 4x V3's layer boundary, and the token ids (int64: hash routing
    reads them when the block runs again); without recompute the block keeps more,
    and a compressed layer (CSA, HCA) more than a window-only one (its entries, the indexer's keys)."""
    args = ModelArgs.preset("debug_v4")
    mb, seq, act = 2, 272, 4
    kept = measure.v4_block(args.replace(recompute=("block",)), layer_id, mb, seq, act, False, 8)
    streams = mb * seq * args.hc_mult * args.dim * act
    ids = mb * seq * 8
    inputs = streams + ids + (mb * seq * args.dim * act if layer_id >= args.n_layers else 0)
    # plus the MoE's running statistics made by the first forward (the balancer's per-expert load counts, tens of
    # bytes, alive after it like any tensor the block keeps): not activations, bounded by one KiB here
    assert inputs <= kept.saved < inputs + 1024, (kept.saved, inputs)
    full = measure.v4_block(args, layer_id, mb, seq, act, False, 8)
    assert full.saved > 4 * kept.saved and kept.transient > full.transient
    if args.compress_ratios[layer_id] and layer_id < args.n_layers:
        assert full.saved > measure.v4_block(args, 0, mb, seq, act, False, 8).saved


def test_pipeline_boundary_carries_four_streams():
    """The memory model's P2P buffers and the planner's P2P time carry the 4 streams (4x the hidden state)."""
    cfg = load_config(FLASH)
    est = estimate(cfg, device="H800")
    tokens = cfg.data.seq_len * cfg.data.micro_batch
    ep_buffers = tokens * 6 * 4096 * (2 * (1 + 4 / 128) + 2) * 2  # dispatch (FP8) and combine, two in flight
    p2p = est.ranks[0].items["comm"] - ep_buffers
    assert p2p == pytest.approx(2 * 2 * tokens * 4 * 4096 * 2)  # send + receive, two directions (a V), 4 streams


@pytest.mark.parametrize("device", ["H800", "H200"])
def test_flash_config_dry_run_fits(device, capsys):
    """``deepseek_v4_flash.toml``'s dry run (284B at 4K) fits 80 GB H800 and 141 GB H200 ranks."""
    assert train.main(["--config", FLASH, "--dry-run", "--device", device]) == 0
    out = capsys.readouterr().out
    assert "model deepseek_v4_flash: 284.3B parameters, 13.3B activated" in out
    assert f"verdict: FITS on {device}" in out, out[-600:]


def test_planner_times_a_v4_layout():
    """The planner evaluates a V4-Flash layout end to end (legality, memory, the simulated step); a V3-only
    recompute policy is illegal for V4."""
    req = Request(load_config(FLASH), load_system("H800"), gpus=256, seq_len=4096, global_batch=1920)
    lay = Layout(pp=8, dp=32, ep=32, schedule="dualpipev", micro_batch=1, microbatches=60, recompute="block")
    ev = evaluate(req, lay)
    assert ev.status == "ok", ev
    assert 0 < ev.mfu < 0.6 and ev.step_time_s > 0
    assert evaluate(req, Layout(**{**lay.__dict__, "recompute": "v3"})).status == "illegal"


def test_plan_reads_a_v4_config_json(tmp_path):
    """``recipes.plan --model`` given a V4 ``config.json`` plans V4 with that file's architecture."""
    from recipes.plan import base_config
    from training.trainer import model_args

    args = ModelArgs.preset("deepseek_v4_flash", n_layers=20, compress_ratios=(0, 4) * 10, index_topk=1024,
                            tie_word_embeddings=True, rope_factor=1.0, original_seq_len=0)
    (tmp_path / "config.json").write_text(json.dumps(args.to_hf_config()))
    got = model_args(base_config(str(tmp_path), []))
    assert isinstance(got, ModelArgs) and got == args.replace(fp8=False)
