"""Muon (``optim.name = "muon"``): the hidden matrices by Newton-Schulz orthogonalised momentum, AdamW for the rest.

Reference: ``torch.optim.Muon`` with the same arguments, on the same gradients. Our update runs the same
operations in the same order on each matrix (bf16 Newton-Schulz, fp32 momentum and parameter), so the derived
tolerance is zero: the results must be the same bits. Grouped expert weights ``[experts, out, in]`` and the fused
``w13 = [w1; w3]`` are compared with ``torch.optim.Muon`` stepping each matrix as a parameter of its own."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v4 import ModelArgs as V4ModelArgs
from models.deepseek_v4 import Transformer as V4Transformer
from planner import Request, load_system
from planner.costs import muon_flops_per_param, newton_schulz_flops
from planner.memory import estimate
from planner.search import Layout, optimizer_seconds, to_config
from recipes import fp8_vs_bf16
from training.config import load_config, validate
from training.optim import (
    Muon,
    Optimizers,
    is_expert_param,
    muon_matrices,
    newton_schulz,
    owners_by_cost,
    uses_muon,
)
from training.trainer import model_args

ROOT = Path(__file__).resolve().parent.parent

KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


def _grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-3, 1, (), generator=g))
            for _ in range(steps)]


def _ours(w0: torch.Tensor, name: str, steps: list[torch.Tensor], **kw) -> tuple[torch.Tensor, Muon]:
    p = nn.Parameter(w0.clone())
    opt = Muon([{"params": [p], "use_muon": True}], moments_dtype=None,
               matrices={id(p): muon_matrices(name, p)}, **{**KW, **kw})
    for g in steps:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def _torch(w0: torch.Tensor, steps: list[torch.Tensor], **kw) -> torch.Tensor:
    p = nn.Parameter(w0.clone())
    opt = torch.optim.Muon([p], **{**KW, **kw})
    for g in steps:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("shape", [(48, 48), (37, 90), (130, 29), (1, 17)])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matrix_update_equals_torch_muon(shape, adjust, nesterov):
    torch.manual_seed(sum(shape))
    w0 = torch.randn(shape)
    steps = _grads(shape, 6, seed=shape[0])
    ours, opt = _ours(w0, "layers.0.attn.wo.weight", steps, adjust_lr_fn=adjust, nesterov=nesterov)
    ref = _torch(w0, steps, adjust_lr_fn=adjust, nesterov=nesterov)
    assert torch.equal(ours, ref), float((ours - ref).abs().max())
    p = opt.param_groups[0]["params"][0]
    assert set(opt.state[p]) == {"step", "momentum_buffer"}  # one buffer, against AdamW's two moments


@pytest.mark.parametrize("name,shape", [("layers.1.ffn.experts.w2", (5, 24, 13)),
                                        ("layers.1.ffn.experts.w13", (3, 2 * 11, 24)),
                                        ("layers.0.ffn.w13.weight", (2 * 19, 24))])
def test_grouped_and_fused_weights_are_one_matrix_each(name, shape):
    """Each expert's matrix (and each half of a fused w13) is orthogonalised alone: the same bits as
    ``torch.optim.Muon`` on the matrices as separate parameters (whose LR scale is their own shape's)."""
    torch.manual_seed(len(name))
    w0 = torch.randn(shape)
    steps = _grads(shape, 4, seed=7)
    ours, _ = _ours(w0, name, steps)
    count, rows, cols = muon_matrices(name, w0)
    assert count * rows * cols == w0.numel() and count > 1
    for i in range(count):
        ref = _torch(w0.reshape(count, rows, cols)[i], [g.reshape(count, rows, cols)[i] for g in steps])
        assert torch.equal(ours.reshape(count, rows, cols)[i], ref), i
    whole = _torch(w0.reshape(-1, cols), [g.reshape(-1, cols) for g in steps])  # one big matrix is different
    assert not torch.equal(ours.reshape(-1, cols), whole)


def test_update_rms_is_the_configured_one():
    """Moonlight's rule: the step is lr x update_rms x sqrt(max(m, n)) times an orthogonal-ish matrix whose RMS is
    ~1 / sqrt(max(m, n)) (singular values near 1 after Newton-Schulz's ~0.7..1.2), so the update's RMS is about
    lr x update_rms (V4 reports 0.18); with weight decay 0 and one step."""
    torch.manual_seed(0)
    w0 = torch.randn(256, 96)
    g = [torch.randn(256, 96)]
    for rms in (0.2, 0.18):
        ours, _ = _ours(w0, "x.weight", g, weight_decay=0.0, update_rms=rms, lr=1.0)
        measured = float((ours - w0).square().mean().sqrt())
        assert 0.6 * rms < measured < 1.3 * rms, (rms, measured)
    ortho = newton_schulz(g[0]).float()
    sv = torch.linalg.svdvals(ortho)
    assert 0.5 < float(sv.min()) and float(sv.max()) < 1.5  # torch's documented US'V^T with S' in ~(0.5, 1.5)


def test_model_split_adamw_for_embedding_head_gate_norms():
    """V4's split on the model's parameter names: embedding, head, router gate, norms and biases by AdamW; every
    other matrix (attention, indexer, dense/shared/routed experts, MTP projection) by Muon, each group with its
    own LR and weight decay from the config."""
    model = Transformer(ModelArgs.preset("debug_dsa", n_layers=2, n_dense_layers=1))
    named = dict(model.named_parameters())
    adamw = {n for n, p in named.items() if not uses_muon(n, p)}
    assert {"embed.weight", "head.weight", "layers.1.ffn.gate.weight", "norm.weight"} <= adamw
    assert all(named[n].ndim == 1 or n.split(".")[-2] in ("embed", "head", "gate") for n in adamw)
    muon = set(named) - adamw
    assert {"layers.1.ffn.experts.w13", "layers.0.attn.indexer.wk.weight", "mtp.0.eh_proj.weight",
            "layers.0.attn.wkv_b.weight"} <= muon
    v4_named = dict(V4Transformer(V4ModelArgs.preset("debug_v4")).named_parameters())
    v4_adamw = {n for n, p in v4_named.items() if not uses_muon(n, p)}
    assert {"layers.1.attn.compressor.ape", "layers.0.hc_attn_base", "layers.0.hc_attn_scale",
            "layers.0.attn.attn_sink", "hc_head.hc_head_base"} <= v4_adamw  # V4: biases, gating factors, sinks
    assert {"layers.0.hc_attn_fn", "layers.1.attn.compressor.wgate.weight", "mtp.0.e_proj.weight"} <= (
        set(v4_named) - v4_adamw)
    cfg = load_config(None, ['optim.name="muon"', "optim.muon_lr=0.03", "optim.muon_weight_decay=0.05",
                             "optim.lr=1e-3", "optim.weight_decay=0.2"]).optim
    opt = Optimizers([model], cfg, None, None, zero1=False)
    by_id = {id(p): n for n, p in named.items()}
    for o in opt.optimizers:
        assert isinstance(o, Muon)
        for group in o.param_groups:
            names = {by_id[id(p)] for p in group["params"]}
            if group["use_muon"]:
                assert names <= muon and (group["lr"], group["weight_decay"]) == (0.03, 0.05)
            else:
                assert names <= adamw and group["lr"] == 1e-3
                assert group["weight_decay"] == (0.2 if all(named[n].ndim == 2 for n in names) else 0.0)
    assert {by_id[id(p)] for g in opt.param_groups for p in g["params"]} == set(named)


def test_adamw_groups_of_muon_equal_torch_adamw():
    """The non-matrix parameters get ``torch.optim.AdamW``'s update, bit for bit (fp32 moments)."""
    torch.manual_seed(3)
    w0 = [torch.randn(33), torch.randn(20, 7)]
    ours = [nn.Parameter(w.clone()) for w in w0]
    ref = [nn.Parameter(w.clone()) for w in w0]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = Muon([{"params": ours, "use_muon": False}], moments_dtype=None, **kw)
    ref_opt = torch.optim.AdamW(ref, **kw)
    for _ in range(5):
        for a, b in zip(ours, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("item,needle", [('optim.name="lion"', "optim.name must be one of adamw, muon, sgd"),
                                         ("optim.muon_lr=0.0", "optim.muon_lr (Muon's LR) must be > 0"),
                                         ("optim.muon_lr=-1e-3", "optim.muon_lr (Muon's LR) must be > 0"),
                                         ('optim.muon_adjust_lr="x"', "optim.muon_adjust_lr must be one of"),
                                         ("optim.muon_momentum=1.0", "optim.muon_momentum must be in [0, 1)"),
                                         ("optim.muon_update_rms=0.0", "optim.muon_update_rms must be > 0")])
def test_bad_values_are_one_line_errors(item, needle):
    with pytest.raises(ValueError) as err:
        validate(load_config(None, ['optim.name="muon"', item]))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_muon_lr_scale_is_moonlights_rule():
    p = nn.Parameter(torch.zeros(64, 16))
    opt = Muon([{"params": [p], "use_muon": True}], lr=0.1, weight_decay=0.0, update_rms=0.18, moments_dtype=None)
    p.grad = torch.eye(64, 16)  # orthogonal already: Newton-Schulz keeps it near itself
    opt.step()
    scale = -p.detach()[:16].diagonal() / 0.1
    assert torch.allclose(scale, torch.full((16,), 0.18 * math.sqrt(64)), rtol=0.35)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_memory_model_counts_the_states_the_optimizer_makes(name):
    """``planner.memory``'s optimizer item for one process equals the bytes of the states the real optimizer holds
    after a step on the same model: Muon one momentum buffer per hidden matrix and AdamW's two moments for the
    rest, so it needs less than AdamW by one buffer of the matrices."""
    sets = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="none"', "model.fp8=false",
            f'optim.name="{name}"']
    cfg = load_config(ROOT / "recipes/configs/tiny_cpu.toml", sets)
    model = Transformer(model_args(cfg))
    opt = Optimizers([model], cfg.optim, None, None, zero1=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    held = sum(t.numel() * t.element_size() for o in opt.optimizers for s in o.state.values()
               for k, t in s.items() if k != "step")
    assert estimate(cfg).ranks[0].items["optimizer"] == held
    if name == "muon":
        matrices = sum(p.numel() for n, p in model.named_parameters() if uses_muon(n, p))
        adamw = estimate(load_config(ROOT / "recipes/configs/tiny_cpu.toml", sets[:-1]))
        assert adamw.ranks[0].items["optimizer"] - held == matrices * 4


def test_planner_newton_schulz_flops_equal_the_counted_step():
    """``planner.costs``' Newton-Schulz FLOPs for a model equal what PyTorch's FLOP counter sees in one real Muon
    step of it (the AdamW part has no matrix products), per matrix split included."""
    args = ModelArgs.preset("debug_dsa", n_layers=2, n_dense_layers=1)
    model = Transformer(args)
    cfg = load_config(None, ['optim.name="muon"']).optim
    opt = Optimizers([model], cfg, None, None, zero1=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    dense = sum(p.numel() for n, p in model.named_parameters() if not is_expert_param(n))
    expert = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    per_dense, per_expert = muon_flops_per_param(args, 1, cfg.muon_ns_steps)
    assert counter.get_total_flops() == pytest.approx(per_dense * dense + per_expert * expert, rel=1e-12)
    assert newton_schulz_flops(96, 32, 5) == newton_schulz_flops(32, 96, 5) == 5 * (4 * 32 * 32 * 96 + 2 * 32**3)


def test_verdict_recipe_variants_change_one_key_each():
    """``recipes.fp8_vs_bf16 --recipes muon,mxfp4_qat``: each variant is the baseline plus its own key (Muon at the
    config's AdamW LR and decay, as Moonlight's RMS match intends), FP8 off, the same seed; a bad name is refused."""
    config = str(ROOT / "recipes/configs/tiny_cpu.toml")
    base = load_config(config, fp8_vs_bf16.variant(1, 5, 7, "bf16", [], config))
    muon = load_config(config, fp8_vs_bf16.variant(1, 5, 7, "muon", [], config))
    fp4 = load_config(config, fp8_vs_bf16.variant(1, 5, 7, "mxfp4_qat", [], config))
    assert (base.optim.name, base.model.fp8, base.model.expert_weight_format) == ("adamw", False, "bf16")
    assert (muon.optim.name, muon.optim.muon_lr, muon.optim.muon_weight_decay) == ("muon", base.optim.lr,
                                                                                    base.optim.weight_decay)
    assert (fp4.model.expert_weight_format, fp4.model.fp8, fp4.optim.name) == ("mxfp4_qat", False, "adamw")
    assert base.run.seed == muon.run.seed == fp4.run.seed == 7
    assert fp8_vs_bf16.parse_recipes("muon,mxfp4_qat") == ["muon", "mxfp4_qat"]
    with pytest.raises(ValueError, match="--recipes must be a comma-separated subset of .*muon, mxfp4_qat"):
        fp8_vs_bf16.parse_recipes("lion")


def test_zero1_ownership_balances_newton_schulz_flops():
    """``owners_by_cost`` (the greedy ``MatrixOwners`` uses): every item owned once; the busiest rank carries at
    most the even share plus one item (Graham's bound for largest-first greedy). Where elements and FLOPs disagree
    (a square matrix and a thin one of the same size: 4096^3 against 64^2 x 262144 multiply-adds per iteration), a
    split by elements (ZeroRedundancyOptimizer's rule) can put all the Newton-Schulz work on one rank; by FLOPs
    each rank gets one square matrix."""
    layer = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384), (2048, 7168), (7168, 2048)]
    for shapes in (layer * 3, [(4096, 4096), (64, 262144)] * 2):
        costs = [newton_schulz_flops(r, c) for r, c in shapes]
        for world in (2, 4):
            owner = owners_by_cost(costs, world)
            load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)]
            assert sum(load) == pytest.approx(sum(costs)) and max(load) <= sum(costs) / world + max(costs)
    shapes = [(4096, 4096), (64, 262144)] * 2
    costs = [newton_schulz_flops(r, c) for r, c in shapes]
    by_elements = owners_by_cost([float(r * c) for r, c in shapes], 2)
    assert by_elements[0] == by_elements[2]  # both square matrices on one rank
    assert owners_by_cost(costs, 2)[0] != owners_by_cost(costs, 2)[2]


@pytest.mark.parametrize("zero1", [True, False])
def test_planner_gives_muon_adamws_collectives_and_its_newton_schulz(zero1, monkeypatch):
    """The planner's optimizer phase (``planner.search.optimizer_seconds``) on one stage over 2 data-parallel ranks:
    Muon's DP communication equals AdamW's, as the runtime's does (both all-reduce the gradients; under ZeRO-1 each
    parameter is then broadcast once by its owner: ZeroRedundancyOptimizer's rank for AdamW, ``MatrixOwners``' for
    Muon); its step adds the Newton-Schulz GEMMs of the rank's share (half the model's under ZeRO-1, all of it
    without) at the BF16 GEMM rate, counted here matrix by matrix on the real model."""
    base = load_config(ROOT / "recipes/configs/tiny_cpu.toml", ["model.fp8=false"])
    req = Request(base, load_system("H100"), 2, base.data.seq_len, 8)
    lay = Layout(pp=1, dp=2, ep=1, schedule="none", micro_batch=1, microbatches=4, fp8=False, zero1=zero1)
    times = {}
    for name in ("adamw", "muon"):
        cfg = to_config(req, lay)
        cfg.optim.name = name
        times[name] = optimizer_seconds(req, lay, cfg, estimate(cfg).ranks, model_args(cfg))
    assert times["muon"][0] == times["adamw"][0] > 0
    cfg = to_config(req, lay)
    cfg.optim.name = "muon"
    # (the module: ``planner.search`` as an attribute path is the package's ``search`` function)
    monkeypatch.setattr(sys.modules["planner.search"], "muon_flops_per_param", lambda *a, **k: (0.0, 0.0))
    traffic_only = optimizer_seconds(req, lay, cfg, estimate(cfg).ranks, model_args(cfg))[1]
    model = Transformer(model_args(cfg))
    total = 0.0
    for name, p in model.named_parameters():
        if uses_muon(name, p):
            count, rows, cols = muon_matrices(name, p)
            total += count * newton_schulz_flops(rows, cols, cfg.optim.muon_ns_steps)
    s = req.system
    expected = total / (2 if zero1 else 1) / (s.bf16_tflops * 1e12 * s.kernel_efficiency("gemm"))
    assert times["muon"][1] - traffic_only == pytest.approx(expected, rel=1e-9)
