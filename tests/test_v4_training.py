"""DeepSeek-V4 in training (issue 37 item 5): the config selects it, its pipeline stages pass the 4-stream
residual (and the token ids hash routing reads) from stage to stage, plainly and as the per-layer plan's pieces,
and equal the plain model; whole-block recompute keeps the gradients and drops the activations; FP8 reaches the
linears V3 runs in FP8. The multi-process runs through ``recipes.train`` are in ``test_v4_training_slow.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models.deepseek_v4 as v4
from models.deepseek_v3 import ModelArgs as V3Args
from models.deepseek_v3.balancing import update_expert_biases
from models.deepseek_v3.expert_parallel import ExpertParallel
from models.deepseek_v3.plan import Run, overlapped
from models.deepseek_v4 import plan as v4_plan
from recipes.train import main as train_main
from tests.dist_utils import run_distributed
from training.config import load_config
from training.experts import wire_moe_layers
from training.loss import StageLoss
from training.parallel import single_process
from training.stages import DeepSeekV4Stage, build_stages, expert_range
from training.trainer import model_args

# fp32 throughout (V4's sparse attention has no float64 kernel). The stage path and the plain model run the same
# modules on the same values; they differ in the head's loss (the fused chunked cross-entropy against
# F.cross_entropy of whole logits) and in the order gradients of shared tensors (the embedding, the streams) are
# summed. The longest such reduction is the mean over the 2 x 64 = 128 tokens (the vocab's log-sum-exp is 256
# wide), each term off by a few units of 2^-24: 256 x 2^-24 = 1.5e-5 relative to the size of the terms -- which
# bounds the loss and the gradients as a whole (all parameters' gradients as one vector). A single parameter's
# gradient may be a near-cancelling sum (mHC's head gates see 4 identical streams at init: their gradients are
# 1e-3 of the others'), so each is held to PARAM_REL = 1e-2 of itself: what a lost, doubled or misrouted
# gradient (>= 100% of itself) cannot meet.
REL = 256 * 2.0**-24
PARAM_REL = 1e-2
SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]


def _args(**changes) -> v4.ModelArgs:
    """debug_v4 at the byte vocabulary: window-only (hash-routed), CSA, HCA, CSA layers and a window-only MTP."""
    return v4.ModelArgs.preset("debug_v4", vocab_size=256, max_seq_len=256, **changes)


def _windows(batch: int = 2, seq: int = 64, seed: int = 0) -> torch.Tensor:
    """Token windows ``[batch, seq + 1]``: 64 tokens reach CSA's top-k (16 entries > index_topk 8) but not HCA."""
    return torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _stages(args: v4.ModelArgs, schedule: str, pp: int, seed: int = 7) -> dict[int, DeepSeekV4Stage]:
    """Every stage of the layout, built as each pipeline rank builds its own (same seeded init)."""
    out = {}
    for rank in range(pp):
        _, held = build_stages(args, schedule, pp, rank, 0, 1, torch.device("cpu"), torch.float32, seed)
        out.update({st.stage_id: st for st in held})
    return out


def _grads(modules) -> dict[str, torch.Tensor]:
    out = {}
    for m in modules:
        for name, p in m.named_parameters():
            if p.grad is not None:
                out[name] = p.grad.detach().clone()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _reference(args: v4.ModelArgs, windows: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's loss (``Transformer.forward`` logits, F.cross_entropy, MTP weighted as the trainer
    weights it) and gradients, from the one-stage build (all of the model materialised, same init)."""
    model, _ = build_stages(args, "none", 1, 0, 0, 1, torch.device("cpu"), torch.float32, 7)
    tokens, labels = windows[:, :-1], windows[:, 1:]
    logits, mtp = model(tokens, return_mtp=True)
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    extra = [F.cross_entropy(lg.flatten(0, 1), labels[:, k:].flatten()) for k, lg in enumerate(mtp, start=1)]
    loss = main + args.mtp_loss_weight / len(extra) * sum(extra)
    loss.backward()
    return float(loss.detach()), _grads([model])


def _check(loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, torch.Tensor]) -> None:
    assert loss == pytest.approx(ref_loss, rel=REL)
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    names = sorted(grads)
    assert _rel(torch.cat([grads[n].flatten() for n in names]), torch.cat([ref[n].flatten() for n in names])) < REL
    for name, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
        assert _rel(g, ref[name]) < PARAM_REL, (name, _rel(g, ref[name]))


def test_config_selects_v4_by_preset_or_hf_config(tmp_path):
    """``model.preset = "debug_v4"`` and ``model.hf_config`` (a V4 or a V3 config.json) pick the family; overrides
    and the FP8 / MTP switches apply on top; an unreadable hf_config names the key."""
    cfg = load_config(None, ["model.preset=debug_v4", "model.overrides.n_layers=2", "model.fp8=true",
                             "model.mtp_lambda=0.1"])
    args = model_args(cfg)
    assert isinstance(args, v4.ModelArgs) and args.n_layers == 2 and args.fp8 == "blockwise"
    assert args.mtp_loss_weight == 0.1
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(_args(n_layers=3).to_hf_config()))
    got = model_args(load_config(None, [f"model.hf_config={tmp_path / 'v4'}", "model.overrides.window_size=8"]))
    assert isinstance(got, v4.ModelArgs) and got.n_layers == 3 and got.window_size == 8 and got.vocab_size == 256
    V3Args.preset("debug").save_hf_config(tmp_path / "v3.json")
    assert type(model_args(load_config(None, [f"model.hf_config={tmp_path / 'v3.json'}"]))) is V3Args
    with pytest.raises(ValueError, match="model.hf_config="):
        model_args(load_config(None, [f"model.hf_config={tmp_path / 'missing'}"]))
    with pytest.raises(ValueError, match="recompute"):
        _args(recompute=("norm",))


def test_stage_chain_passes_streams_and_equals_the_model():
    """A 4-stage V (DualPipeV / ZB-V with pp = 2), each stage's output handed to the next detached as a pipeline
    message (streams ``[b, s, 4, dim]`` and the token ids), its gradient handed back: loss and every gradient
    equal the plain model's. The hash-routed layer 0 sits on stage 0 and layers 1-3 read the tokens passed on."""
    args = _args()
    windows = _windows()
    ref_loss, ref = _reference(args, windows)
    stages = _stages(args, "dualpipev", 2)
    assert sorted(stages) == [0, 1, 2, 3]
    criterion = StageLoss(stages[3], args.mtp_loss_weight)
    x, inputs = windows[:, :-1], []
    for s in range(3):
        out = stages[s](*([x] if s == 0 else x))
        h, tokens = out
        assert h.shape == (2, 64, args.hc_mult, args.dim) and torch.equal(tokens, windows[:, :-1])
        x = [h.detach().requires_grad_(), tokens]
        inputs.append((h, x[0]))
    loss = criterion(stages[3](*x), windows)
    loss.backward()
    for h, received in reversed(inputs):
        h.backward(received.grad)
    _check(float(loss.detach()), _grads(stages.values()), ref_loss, ref)


def test_stage_runs_as_plan_pieces_equal_the_model():
    """The same chain through the per-layer plan's interface (``forward_run`` / ``backward_run``: what the runtime
    calls for every schedule), block recompute on: loss and gradients equal the plain model's (no recompute)."""
    windows = _windows(seed=1)
    ref_loss, ref = _reference(_args(), windows)
    args = _args(recompute=("block",))
    stages = _stages(args, "zbv", 2)
    criterion = StageLoss(stages[3], args.mtp_loss_weight)
    runs, received, inputs = [], [], [windows[:, :-1]]
    for s in range(4):
        out, loss, run = stages[s].forward_run(inputs, criterion if s == 3 else None, [windows] if s == 3 else [])
        runs.append(run)
        if s < 3:
            inputs = [out[0].detach().requires_grad_(), out[1]]
            received.append(inputs[0])
    stages[3].backward_run(runs[3], loss, [])
    for s in (2, 1, 0):
        stages[s].backward_run(runs[s], None, [received[s].grad])
    _check(float(loss.detach()), _grads(stages.values()), ref_loss, ref)
    assert len(criterion.parts) == 1  # the loss ran once, as the last pieces of stage 3


def _saved_bytes(args: v4.ModelArgs, windows: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one stage's forward and loss."""
    (stage,) = _stages(args, "none", 1).values()
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        StageLoss(stage, args.mtp_loss_weight)(stage(windows[:, :-1]), windows)
    return sum(saved)


def test_block_recompute_keeps_only_block_inputs():
    """``recompute = ["block"]`` saves a fraction of the activations (each block keeps its input streams; the
    head and loss are not blocks) -- the gradients are checked in the plan-pieces test above."""
    windows = _windows()
    full, recomputed = _saved_bytes(_args(), windows), _saved_bytes(_args(recompute=("block",)), windows)
    assert recomputed < 0.5 * full, (recomputed, full)


def test_fp8_reaches_the_linears_v3_runs_in_fp8():
    """``fp8`` runs what V3 runs in FP8 (and V4's release stores in FP8): the routed experts' grouped GEMMs, the
    shared expert and the attention's and indexer's query / key-value / output projections (blockwise e4m3, 1x128
    activations, 128x128 weights); the compressors, the indexer's head weights, routers, mHC, embedding and head
    stay as they are. The loss moves off fp32's by rounding (e4m3 keeps 3 mantissa bits: ~2^-5 relative per
    product, averaged over the 32-64 long dot products) but stays within 1e-2 of it; every gradient is finite."""
    windows = _windows()
    losses = []
    for fp8 in (False, "blockwise"):
        args = _args(fp8=fp8)
        (stage,) = _stages(args, "none", 1).values()
        layer = stage.layers["1"]  # a CSA layer: attention, indexer and compressor
        for m in (layer.attn.wq_a, layer.attn.wq_b, layer.attn.wkv, layer.attn.wo_b, layer.attn.indexer.wq_b,
                  layer.ffn.shared_experts.w1, layer.ffn.experts):
            assert m.fp8 == fp8
        assert not hasattr(layer.attn.compressor.wkv, "fp8") and not hasattr(stage.head, "fp8")
        loss = StageLoss(stage, args.mtp_loss_weight)(stage(windows[:, :-1]), windows)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in stage.parameters() if p.grad is not None)
        losses.append(float(loss.detach()))
    assert losses[0] != losses[1] and math.isclose(losses[0], losses[1], rel_tol=1e-2), losses


@pytest.mark.parametrize("setting, message", [
    ("model.hf_config={tmp}/missing", "error: model.hf_config="),
    ("model.init_from={tmp}/v3", "error: model.init_from="),
    ("parallel.cp=2 parallel.dp=1", "error: model.preset='debug_v4': DeepSeek-V4 trains without context parallelism"),
    ("model.overrides.recompute=[\"norm\"]", "error: ModelArgs: recompute=['norm']"),
])
def test_v4_launch_refusals_name_the_key(tmp_path, capsys, setting, message):
    """What V4 training does not do yet, or cannot read, is refused before any process starts, in one line naming
    the key (exit 2); the dry run of the demo config passes the same checks and prints its memory estimate."""
    (tmp_path / "config.json").write_text(json.dumps(_args().to_hf_config()))
    (tmp_path / "v3").mkdir()
    (tmp_path / "v3" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    argv = ["--config", "recipes/configs/v4_tiny_cpu.toml", "--dry-run"]
    for one in setting.format(tmp=tmp_path).split():
        argv += ["--set", one]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert train_main(["--config", "recipes/configs/v4_tiny_cpu.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "per-rank memory" in out and "CSA layer" in out, out


def _ep_plan_rank(rank: int, world: int) -> dict[str, float]:
    """One EP rank: a hash-routed and a scored V4 layer as plan pieces over the EP all-to-alls, micro-batch a's
    forward overlapped with micro-batch b's backward, against the full model run plainly on every rank's data."""
    args = _args(n_layers=2, n_mtp_layers=0)
    torch.manual_seed(0)
    full = v4.Transformer(args)  # every rank draws the same weights
    with torch.device("meta"):
        model = v4.Transformer(args, expert_ids=expert_range(args, rank, world))
    model.to_empty(device="cpu")
    experts = model.layers[0].ffn.experts.expert_ids
    with torch.no_grad():
        for (name, p), src in zip(model.named_parameters(), full.parameters()):
            p.copy_(src[experts.start:experts.stop] if ".experts." in name else src)
        for b, src in zip(model.buffers(), full.buffers()):
            b.copy_(src)
    for block in model.layers:
        block.ffn.ep = ExpertParallel(args.n_routed_experts, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1)
    data = [[(torch.randint(0, 256, (1, 48), generator=gen), torch.randn(1, 48, args.hc_mult, args.dim, generator=gen),
              torch.randn(1, 48, args.hc_mult, args.dim, generator=gen)) for _ in range(2)] for _ in range(world)]
    rope = v4_plan.angles(args, 48, "cpu")

    def run(mb: int) -> tuple[Run, torch.Tensor]:
        tokens, h, _ = data[rank][mb]
        h = h.clone().requires_grad_()
        pieces = [p for block in model.layers for p in v4_plan.layer_pieces(block, rope)]
        assert len(pieces) == 10  # five per expert-parallel layer
        return Run(pieces, keep=("h", "tokens"), h=h, tokens=tokens), h

    run_b, h_b = run(1)
    run_b.forward()
    run_a, h_a = run(0)
    overlapped(run_a, run_b, h=data[rank][1][2])
    run_a.backward(h=data[rank][0][2])
    inputs, dense, routed = [], {}, {}
    for r in range(world):  # the reference: the plain layers on rank r's micro-batches
        full.zero_grad()
        for tokens, h, g in data[r]:
            h = h.clone().requires_grad_()
            y = h
            for block in full.layers:
                y = block(y, rope, tokens)
            y.backward(g)
            inputs.append(h.grad)
        for name, p in full.layers.named_parameters(prefix="layers"):
            if p.grad is None:  # a parameter these micro-batches did not reach
                continue
            if ".experts." in name:  # the experts see every rank's tokens
                routed[name] = routed.get(name, 0) + p.grad[experts.start:experts.stop]
            elif r == rank:  # the rest this rank's only
                dense[name] = p.grad.clone()
    errors = {"input": max(_rel(a, b) for a, b in zip((h_a.grad, h_b.grad), inputs[2 * rank: 2 * rank + 2]))}
    for name, p in model.layers.named_parameters(prefix="layers"):
        if name in routed or name in dense:
            errors[name] = _rel(p.grad, routed[name] if name in routed else dense[name])
        else:
            assert p.grad is None, name
    return errors


@pytest.mark.dist
def test_ep_plan_pieces_overlapped_equal_the_plain_layers():
    """Two EP ranks run a hash-routed and a scored layer as the per-layer plan's pieces (attention with the mHC
    collapse / dispatch / experts / combine / output with the mHC spread), one micro-batch's forward interleaved with
    the other's backward (DualPipe's overlapped chunk): every gradient equals the plain layers' (the experts' summed
    over both ranks' tokens) within REL: no loss head here, the sums differ only in the order the experts' rows
    come back (measured: <= 1e-7 relative)."""
    for errors in run_distributed(_ep_plan_rank, 2, timeout=150):
        assert len(errors) > 40 and all(e < REL for e in errors.values()), {k: e for k, e in errors.items() if e >= REL}


def test_hash_layers_are_measured_but_not_balanced():
    """Under ``balance.strategy = "aux_free"`` the scored layers' biases move with their loads; a hash-routed layer
    (``fixed_routing``: no router decision, no bias) gets a measuring balancer and the bias update passes it by."""
    args = _args(n_layers=2, n_mtp_layers=0)
    model = v4.Transformer(args)
    cfg = load_config(None, ["model.preset=debug_v4", "balance.strategy=aux_free", *SINGLE])
    layers = [block.ffn for block in model.layers]
    assert [m.fixed_routing for m in layers] == [True, False]
    wire_moe_layers([model], cfg, single_process(cfg.parallel))
    assert [m.balancer.config.uses_bias for m in layers] == [False, True]
    model(_windows()[:, :-1])
    assert all(m.balancer.counts_for_update.sum() == 2 * 64 * args.n_activated_experts for m in layers)
    assert update_expert_biases(model, gamma=0.1) == 1
    assert layers[0].gate.bias is None and layers[1].gate.bias.abs().sum() > 0
