"""BF16 working weights with FP32 master weights in the optimizer and FP32 gradient accumulation
(``run.dtype = "bfloat16"`` + ``optim.master_dtype = "float32"``, DeepSeek-V3 report 3.3).

References: float64 AdamW math on the same gradients; a float64 sum of the same micro-batch
gradients; the unsharded optimizer for ZeRO-1; a one-process run for a two-process run."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from accel import grads
from deep_gemm.linear import Fp8Linear
from dualpipe.weight_grad import LinearWithDeferredWGrad
from tests.dist_utils import run_distributed
from training.config import load_config
from training.optim import AdamW, Optimizers, clip_grad_norm, optimizer_spec, reduce_gradients

U = 2.0**-24  # fp32 unit roundoff
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _bf16_params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (300,), (5, 3, 2)]
    return [nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def _grad_steps(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-3, 1, (), generator=g))
             for p in params] for _ in range(steps)]


def _adamw_float64(w: torch.Tensor, steps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW (torch's formulation) in float64 from ``w``: (final weights, largest |update| of any step)."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    biggest = torch.zeros_like(w)
    for t, g in enumerate(steps, start=1):
        g = g.double()
        w = w * (1 - LR * WD)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        update = (LR / (1 - BETAS[0] ** t)) * m / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
        w = w - update
        biggest = torch.maximum(biggest, update.abs())
    return w, biggest


def test_adamw_fp32_master_on_bf16_params_equals_float64_adamw():
    """The master follows float64 AdamW within the fp32 rounding of each step, the parameter is exactly the
    master rounded to nearest bf16, the moments are fp32 (the master's dtype), and a pure-bf16 AdamW on the
    same gradients does not come close (its updates of ~lr = 1e-3 are below half a bf16 ulp of |w| ~ 1).

    Bound per element and step: the decay, the update and the moments' recurrences each round a few
    times in fp32, so |error| grows by at most ~4 u |w| + 32 u |update|; summed over the steps."""
    params = _bf16_params()
    opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, moments_dtype=None,
                master_dtype=torch.float32)
    grads.keep_main_grads(params)
    init = [p.detach().float().clone() for p in params]
    steps = _grad_steps(params, 12)
    plain = [nn.Parameter(p.detach().clone()) for p in params]  # bf16 AdamW without a master
    plain_opt = torch.optim.AdamW(plain, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in steps:
        for p, q, g in zip(params, plain, step):
            grads.zero_grad(p)
            grads.accumulate_grad(p, g)
            q.grad = g.to(torch.bfloat16)
        opt.step()
        plain_opt.step()
    for p, q, w0, column in zip(params, plain, init, zip(*steps)):
        state = opt.state[p]
        assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), state["master"].to(torch.bfloat16))
        ref, biggest = _adamw_float64(w0, list(column))
        bound = len(column) * (4 * U * ref.abs() + 32 * U * biggest)
        err = (state["master"].double() - ref).abs()
        assert (err <= bound).all(), float((err / bound).max())
        assert ((q.detach().double() - ref).abs() > 100 * bound).any()  # bf16 alone loses the updates


def _micro_batch_grads(layer_factory, k: int, seed: int = 0):
    """Accumulate ``k`` micro-batches into a bf16 layer with fp32 main grads; return (main grad, float64 sum
    of the same micro-batch gradients, the gradient a bf16 accumulation gives)."""
    torch.manual_seed(seed)
    ours = layer_factory()
    single = layer_factory()  # one micro-batch at a time: its buffer holds that micro-batch's gradient as made
    summed = layer_factory()  # plain bf16 accumulation in .grad
    for other in (single, summed):
        other.load_state_dict(ours.state_dict())
    grads.keep_main_grads([ours.weight, single.weight])
    grads.zero_grad(ours.weight)
    total = torch.zeros_like(ours.weight, dtype=torch.float64)
    magnitude = torch.zeros_like(total)
    for i in range(k):
        x = torch.randn(8, ours.weight.shape[1]).to(torch.bfloat16)
        dy = torch.randn(8, ours.weight.shape[0]).to(torch.bfloat16) * (1 + i % 7)
        grads.zero_grad(single.weight)
        for layer in (ours, single, summed):
            (layer(x) * dy).sum().backward()
        total += grads.grad(single.weight).double()
        magnitude += grads.grad(single.weight).double().abs()
    return grads.grad(ours.weight), total, summed.weight.grad, magnitude


@pytest.mark.parametrize("factory", [
    lambda: nn.Linear(48, 40, bias=False).to(torch.bfloat16),  # autograd's AccumulateGrad -> the hook
    lambda: Fp8Linear(48, 40, bias=False, fp8=False).to(torch.bfloat16),  # deep_gemm's in-place wgrad add
    lambda: Fp8Linear(48, 40, bias=False, fp8=True).to(torch.bfloat16),  # the same with its fp32 FP8 wgrad
    lambda: LinearWithDeferredWGrad(48, 40, bias=False).to(torch.bfloat16),  # dualpipe's deferred W
], ids=["autograd", "deep_gemm", "deep_gemm_fp8", "dualpipe"])
def test_fp32_gradient_accumulation_matches_float64_where_bf16_would_not(factory):
    """64 micro-batches: the fp32 buffer equals the float64 sum of the micro-batches' own gradients (each as its
    backward made it: bf16, or fp32 from the FP8 wgrad GEMM) within fp32 summation error ((k - 1) u sum|g_i|
    per element); accumulating in bf16 misses that bound by far."""
    k = 64
    main, total, bf16_sum, magnitude = _micro_batch_grads(factory, k)
    assert main.dtype == torch.float32
    bound = (k - 1) * U * magnitude
    assert ((main.double() - total).abs() <= bound).all()
    assert ((bf16_sum.double() - total).abs() > 100 * bound).any()  # the test discriminates


def _optimizers_run(rank: int, world: int, zero1: bool, steps: int) -> list[list[torch.Tensor]]:
    """A two-module model (dense + one expert-named parameter) with the option on: equal gradients on every
    rank (as after reduce_gradients), ``steps`` clipped steps; returns [params, masters] in fp32."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(33, 17), "b": nn.Linear(20, 31), "experts": nn.Linear(9, 5, bias=False)})
    model = model.to(torch.bfloat16)
    cfg = load_config(None, ["run.dtype=\"bfloat16\"", "optim.master_dtype=\"float32\"", f"optim.lr={LR}"]).optim
    group = torch.distributed.group.WORLD if world > 1 else None
    opt = Optimizers([model], cfg, group, group, zero1=zero1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            grads.accumulate_grad(p, torch.randn(p.shape, generator=g))
        reduce_gradients(opt, group, group, world)
        clip_grad_norm(opt, 1.0, world, 1)  # ep 1: both ranks hold the same expert tensor
        opt.step()
    masters = {}
    for o in opt.optimizers:
        local = getattr(o, "optim", o)
        masters.update({id(p): s["master"] for p, s in local.state.items()})
    params = [p.detach().float() for p in model.parameters()]
    return [params, [masters[id(p)] if id(p) in masters else None for p in model.parameters()]]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_zero1_sharded_master_weights_equal_unsharded():
    """2 gloo ranks with ZeRO-1: each rank updates its shard's masters, the bf16 parameters are broadcast;
    the parameters equal the unsharded one-process optimizer's bit for bit (the same elementwise fp32
    operations on the same values), and together the ranks' masters are the unsharded masters."""
    ref_params, ref_masters = _optimizers_run(0, 1, False, 4)
    results = run_distributed(_optimizers_run, 2, True, 4, timeout=100)
    for params, _ in results:
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    owned = [[m is not None for m in masters] for _, masters in results]
    assert all(a != b for a, b in zip(*owned)) and all(any(o) for o in owned)  # one owner each; both own some
    for i, ref in enumerate(ref_masters):
        mine = next(masters[i] for _, masters in results if masters[i] is not None)
        assert torch.equal(mine, ref)


@pytest.mark.parametrize("sets, message", [
    (["optim.master_dtype=\"float32\""], "optim.master_dtype='float32' .* needs run.dtype='bfloat16'"),
    (["run.dtype=\"float64\"", "optim.master_dtype=\"float32\""],
     "needs run.dtype='bfloat16', got run.dtype='float64'"),
    (["run.dtype=\"bfloat16\"", "optim.master_dtype=\"float32\"", "optim.name=\"sgd\""],
     "optim.master_dtype='float32' needs optim.name='adamw'.*choices for it: adamw, muon, sgd"),
    (["optim.master_dtype=\"bfloat16\""], "optim.master_dtype must be one of param, float32"),
])
def test_bad_master_weight_configs_name_the_key_and_choices(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, sets)


def test_the_option_picks_our_adamw_with_an_fp32_master():
    cls, kw = optimizer_spec(load_config(None, ["run.dtype=\"bfloat16\"", "optim.master_dtype=\"float32\""]).optim)
    assert cls is AdamW and kw["master_dtype"] == torch.float32 and kw["moments_dtype"] is None
    assert math.isclose(kw["lr"], 2.2e-4)


V3_PRECISION = ["run.dtype=\"bfloat16\"", "optim.master_dtype=\"float32\"", "optim.moments_dtype=\"bfloat16\"",
                "optim.ema_decay=0.9"]


@pytest.mark.timeout(300)
def test_checkpoint_resume_with_master_weights_is_bit_exact_and_export_takes_the_masters(tmp_path):
    """V3's precision (BF16 weights, FP32 masters, BF16 moments, host EMA) through the trainer's checkpoint hooks:
    stop at step 3, resume, and losses, BF16 weights, FP32 masters, moments and EMA equal a straight run's bit
    for bit; the HF export of the step-3 checkpoint holds the FP32 masters, not the BF16 weights."""
    from recipes.export_hf import assemble_model
    from tests.test_checkpoint_trainer import _cfg, _train
    from training.checkpoint.reshard import split_expert_name

    straight, a = _train(tmp_path / "a", _cfg(5, V3_PRECISION))
    first, stopped = _train(tmp_path / "b", _cfg(5, V3_PRECISION), stop_at=3)
    exported = assemble_model(tmp_path / "b" / "checkpoints" / "step_000000003").state_dict()
    names = stopped.param_names()
    rounded_somewhere = False
    for p, state in ((p, s) for opt in stopped.optimizer.optimizers for p, s in opt.state.items()):
        key = split_expert_name(names[id(p)])[0]
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], state["master"]), key
        rounded_somewhere |= not torch.equal(exported[key], p.detach().float())
    assert rounded_somewhere
    second, b = _train(tmp_path / "b", _cfg(5, V3_PRECISION), resume="auto")
    assert {**first, **second} == {k: v for k, v in straight.items() if k != 3}
    for pa, pb in zip(a.modules.parameters(), b.modules.parameters()):
        assert pb.dtype == torch.bfloat16 and torch.equal(pa, pb)
        assert grads.grad(pb).dtype == torch.float32
    for oa, ob in zip(a.optimizer.optimizers, b.optimizer.optimizers, strict=True):
        oa.wait_ema(), ob.wait_ema()
    for pa, pb in zip(a.modules.parameters(), b.modules.parameters()):
        sa, sb = (next(o.state[p] for o in t.optimizer.optimizers if p in o.state) for p, t in ((pa, a), (pb, b)))
        assert sb["master"].dtype == torch.float32 and sb["exp_avg"].dtype == torch.bfloat16
        assert sb["ema"].dtype == torch.float32 and sb["ema"].device.type == "cpu"
        for key in ("master", "exp_avg", "exp_avg_sq", "ema"):
            assert torch.equal(sa[key], sb[key]), key


def test_memory_model_counts_bf16_weights_fp32_grads_and_sharded_masters():
    """Per rank of the 671B layout: weights 2 B/param instead of 4, gradients still 4 B/param, and the optimizer
    item grows by exactly the 4 B/param master over its ZeRO-1 shards (dense / dp, experts / (dp / ep)); the
    dry run's header says so, and every rank fits the H800 with the allocator margin included."""
    from planner.memory import estimate, format_estimate
    from training.trainer import model_args

    path = "recipes/configs/deepseek_v3_671b.toml"
    v3 = load_config(path)
    assert (v3.run.dtype, v3.optim.master_dtype) == ("bfloat16", "float32")
    fp32 = load_config(path, ["run.dtype=\"float32\"", "optim.master_dtype=\"param\""])
    ours, base = estimate(v3, device="H800"), estimate(fp32, device="H800")
    par = v3.parallel
    for a, b in zip(base, ours):
        dense = a.params - a.expert_params
        assert b.items["weights"] * 2 == a.items["weights"] == 4 * a.params
        assert b.items["gradients"] == a.items["gradients"]
        master = 4 * (dense / par.dp + a.expert_params / (par.dp // par.ep))
        assert b.items["optimizer"] - a.items["optimizer"] == pytest.approx(master, abs=2)
    assert ours.fits and all(r.total_bytes <= ours.capacity_bytes for r in ours)
    text = format_estimate(v3, model_args(v3), ours)
    assert "weights bfloat16 2 B/param, grads float32 4 B/param, float32 master weights 4 B/param" in text


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("DSV3_MASTER_DIST"), reason="~2-4 min on 2 cores: set DSV3_MASTER_DIST=1")
def test_two_process_run_with_master_weights_matches_one_process(tmp_path):
    """DualPipeV dp 2 x EP 2 (2 processes, ZeRO-1 sharding the masters and BF16 moments), and the same with EPLB
    re-planning every step (masters move with the expert rows, replicas' FP32 gradients are summed), against one
    process of the same model, data and seed, all with BF16 weights and FP32 masters, 4 steps (FP8 off: CPU time).

    The runs differ in bf16 rounding only: expert GEMMs group other tokens, each micro-batch's weight gradient
    is a bf16 GEMM output whose rounding (~2^-8 relative per element) depends on that grouping, and the fp32
    all-reduce sums in another order. Step 1 has equal weights: its loss differs by averaged rounding noise,
    at most 2^-8 L / sqrt(tokens). Each update then carries a ~2^-8 relative perturbation of its direction,
    so the loss at step k may differ by 2 x 2^-8 of what the loss has moved since step 1 (factor 2: the
    perturbations of both runs). A missing gradient reduction or a wrong expert shard moves step 2 by
    > 1e-2 (test_training's fp32 comparison), far outside. Gradient norms: 2^-6 relative (bf16 gradients
    through ~10 rounded ops per block). Final masters: Adam normalises each element's update, so elements
    whose gradient is within bf16 noise of zero may step the other way; the difference is bounded in norm
    by a quarter of how far the masters moved."""
    from recipes.export_hf import assemble_model
    from tests.test_training import SINGLE, _train
    from training.stages import build_stages
    from training.trainer import model_args

    common = ["run.steps=4", "model.fp8=false", "checkpoint.final=true", "checkpoint.interval=0",
              "checkpoint.async_save=false", "optim.warmup_steps=2", "data.seq_len=32", "data.global_batch=16",
              "data.micro_batch=2", *V3_PRECISION[:3]]
    two_procs = ["parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=dualpipev"]
    eplb = ["eplb.enabled=true", "eplb.redundant_experts=2", "eplb.interval=1"]
    runs = {name: [r for r in _train(tmp_path, name, n, common + extra)[0] if "grad_norm" in r]
            for name, n, extra in (("one", 1, SINGLE), ("two", 2, two_procs), ("eplb", 2, two_procs + eplb))}
    assert any(r.get("eplb_moved_slots", 0) > 0 for r in runs["eplb"])  # experts (and their masters) moved
    cfg = load_config("recipes/configs/tiny_cpu.toml", SINGLE)
    _, stages = build_stages(model_args(cfg), "none", 1, 0, 0, 1, torch.device("cpu"), torch.bfloat16, cfg.run.seed)
    init = {k: v for st in stages for k, v in st.state_dict().items()}
    masters = {n: assemble_model(tmp_path / n / "checkpoints" / "step_000000004").state_dict() for n in runs}
    tokens, one, m1 = 16 * 32, runs["one"], masters["one"]
    first = one[0]["loss"]
    for name in ("two", "eplb"):
        for a, b in zip(one, runs[name], strict=True):
            tol = 2**-8 * first / math.sqrt(tokens) + 2 * 2**-8 * abs(first - a["loss"])
            assert abs(a["loss"] - b["loss"]) <= tol, (name, a["step"], a["loss"], b["loss"], tol)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2**-6), name
        moved = diff = 0.0
        for key, start in init.items():
            if key.endswith("e_score_correction_bias") or not start.is_floating_point():  # buffers: not optimized
                continue
            assert masters[name][key].dtype == torch.float32
            moved += float((m1[key].double() - start.double()).square().sum())
            diff += float((masters[name][key].double() - m1[key].double()).square().sum())
        assert 0 < diff and math.sqrt(diff) <= 0.25 * math.sqrt(moved), (name, math.sqrt(diff / moved))
