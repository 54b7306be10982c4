"""MXFP4 QAT of the routed experts under blockwise FP8 (``model.expert_weight_format = "mxfp4_qat"`` with
``model.fp8 = true``, ``fp8_recipe = "blockwise"``): the experts' forward is the FP8 x MXFP4 grouped GEMM
(``torch.ops.dsv3.m_grouped_fp8_fp4_gemm_nt_contiguous``) on the rows' 1x128 cast and the packed FP4 weight; the
dgrad is the 1x128 cast of dY times the dequantised FP4 weight; the wgrad is blockwise FP8's, straight through to the
master weight.

References (float64, independent of the ops): the dequantised 1x128 cast of the valid rows (``per_token_cast_to_fp8``
then ``dequantize``) times ``mxfp4_fake_quant`` of the master weight (itself bit-equal to a float64 OCP MX
implementation in test_mxfp4), group by group. Every product of an e4m3 value, an fp32 scale and an MXFP4 value is
exact in float64, so the layer's error is its own arithmetic:
- forward: fp32 sums over K in 128-wide steps, each times its fp32 row scale (K + 1 roundings per term: (K + 1) u
  sum |a||b|, u = 2^-24), then the bf16 output (half an ulp, 2^-8 relative);
- dgrad: one fp32 GEMM over N (N u sum |dy||w|) on the dequantised cast of dY (the same cast as the reference's).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from accel import registry
from deep_gemm import grouped_linear, per_token_cast_to_fp8
from deep_gemm.mxfp4 import mxfp4_fake_quant
from deep_gemm.reference import dequantize
from models.deepseek_v3 import ModelArgs
from recipes.train import main as train_main
from tests.matrix import train_cli
from tests.test_combinations import FP8_LOSS_ATOL, LOSS_ATOL
from tests.test_muon_dist import LOSS_ATOL as MUON_LOSS_ATOL
from tests.test_muon_dist import STEP1_ATOL
from tests.test_opcheck import ALL_CHECKS, _schema_check_fp8
from training.config import load_config

U = 2.0**-24
OP = "deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous"


def _layout(sizes: list[int]) -> torch.Tensor:
    """Contiguous grouped layout: group g's rows then -1 padding up to a multiple of 128."""
    parts = []
    for g, n in enumerate(sizes):
        pad = -n % 128
        parts += [torch.full((n,), g), torch.full((pad,), -1)]
    return torch.cat(parts).int()


def _dequant_cast(x: torch.Tensor) -> torch.Tensor:
    """The 1x128 e4m3 cast's values in float64 (K zero-padded to 128 as the layer pads it)."""
    k = x.shape[1]
    return dequantize(*per_token_cast_to_fp8(torch.nn.functional.pad(x, (0, -k % 128)))).double()[:, :k]


def _grouped64(a: torch.Tensor, w: torch.Tensor, m: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, ...]:
    out_cols = w.shape[1] if transpose else w.shape[2]
    out = torch.zeros(a.shape[0], out_cols, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for g in range(w.shape[0]):
        rows = m == g
        wg = w[g].double().T if transpose else w[g].double()
        out[rows], mag[rows] = a[rows] @ wg, a[rows].abs() @ wg.abs()
    return out, mag


@pytest.mark.parametrize("sizes,n,k", [([100, 0, 37], 72, 200), ([128, 20], 48, 256)])
def test_blockwise_qat_layer_against_float64(sizes, n, k):
    """Forward through the FP8 x MXFP4 op (its reference ran), dgrad through the dequantised FP4 weight, both within
    the module docstring's bounds of float64; padding rows give 0; the master weight's gradient is blockwise FP8's
    wgrad of the same layer given the FP4 weight (the wgrad reads no weight: straight through), bit for bit."""
    g = torch.Generator().manual_seed(k + n)
    m = _layout(sizes)
    x = (torch.randn(m.numel(), k, generator=g) * 10.0 ** torch.randint(-2, 2, (m.numel(), 1), generator=g))
    x.requires_grad_(True)
    master = torch.nn.Parameter(torch.randn(len(sizes), n, k, generator=g) * 0.05)
    dy = torch.randn(m.numel(), n, generator=g)
    before = registry.reference_call_count(OP)
    out = grouped_linear(x, master, m, fp8=True, weight_format="mxfp4_qat")
    assert registry.reference_call_count(OP) == before + 1  # the FP8 x MXFP4 grouped GEMM did the forward
    (out * dy).sum().backward()
    valid = m >= 0
    w4 = mxfp4_fake_quant(master.detach())
    ref, mag = _grouped64(_dequant_cast(x.detach() * valid[:, None]), w4, m, transpose=True)
    bound = 2.0**-8 * ref.abs() + (k + 1) * U * mag
    assert ((out.double() - ref).abs() <= bound).all() and (out[~valid] == 0).all()
    assert float((out.detach().double() - ref).abs().max()) > 0  # the bound is not vacuous: the GEMM rounds
    ref_dx, mag_dx = _grouped64(_dequant_cast(dy * valid[:, None]), w4, m, transpose=False)
    assert ((x.grad.double() - ref_dx).abs() <= n * U * mag_dx + U * ref_dx.abs()).all()
    assert (x.grad[~valid] == 0).all()
    # not the blockwise FP8 GEMM of the master weight: the FP4 rounding is visible in the forward
    assert not torch.allclose(out, grouped_linear(x.detach(), master.detach(), m, fp8=True), atol=1e-3)
    fp4 = torch.nn.Parameter(w4.clone())
    (grouped_linear(x.detach(), fp4, m, fp8=True) * dy).sum().backward()
    assert torch.equal(master.grad, fp4.grad)


def test_blockwise_qat_takes_a_precast_and_caches_it():
    """The fused permute's precast (the rows' 1x128 cast) gives the same output and gradients as the layer's own
    cast, with and without FP8 activation caching."""
    g = torch.Generator().manual_seed(3)
    m = _layout([90, 60])
    x = torch.randn(m.numel(), 128, generator=g) * (m >= 0)[:, None]
    master = torch.nn.Parameter(torch.randn(2, 64, 128, generator=g) * 0.05)
    dy = torch.randn(m.numel(), 64, generator=g)
    results = []
    for precast, cache in ((False, False), (True, True), (False, True)):
        xi = x.clone().requires_grad_(True)
        master.grad = None
        out = grouped_linear(xi, master, m, fp8=True, fp8_cache=cache, weight_format="mxfp4_qat",
                             x_fp8=per_token_cast_to_fp8(x) if precast else None)
        (out * dy).sum().backward()
        results.append((out, xi.grad, master.grad.clone()))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("fp8_cache", [False, True])
def test_opcheck_grouped_linear_with_blockwise_qat(fp8_cache):
    """``dsv3::grouped_linear`` with ``mxfp4=True`` under blockwise FP8 (K and N not multiples of 128): schema, fakes,
    registered autograd and AOT dispatch."""
    g = torch.Generator().manual_seed(5)
    m = torch.tensor([0] * 100 + [-1] * 28 + [2] * 128 + [1] * 5 + [-1] * 123, dtype=torch.int32)
    xg = torch.randn(384, 200, generator=g, requires_grad=True)
    wg = torch.randn(3, 136, 200, generator=g, requires_grad=True)
    args = (xg, wg, m, "blockwise", fp8_cache, None, None, True)
    op = torch.ops.dsv3.grouped_linear.default
    _schema_check_fp8(op, args, {})
    torch.library.opcheck(op, args, test_utils=ALL_CHECKS[1:])


def test_fp4_experts_without_routed_experts_are_refused_in_one_line(capsys, monkeypatch):
    """``mxfp4_qat`` (or ``fp8``) expert weights on a model whose every layer is dense would train in BF16 while the
    config says FP4: refused by ``ModelArgs`` and by ``recipes.train`` (exit 2, one ``error:`` line, no process)."""
    with pytest.raises(ValueError, match="expert_weight_format='mxfp4_qat' is the routed experts' weight format, "
                                         "and this model has none") as err:
        ModelArgs.preset("debug", n_layers=2, n_dense_layers=2, n_mtp_layers=0, expert_weight_format="mxfp4_qat")
    assert "\n" not in str(err.value)
    ModelArgs.preset("debug", n_layers=2, n_dense_layers=2, n_mtp_layers=1, expert_weight_format="mxfp4_qat")  # MTP
    monkeypatch.setattr("recipes.train.relaunch", lambda *a, **k: pytest.fail("a process started"))
    argv = ["--config", "recipes/configs/tiny_cpu.toml", "--dry-run", "--nproc", "1"]
    for item in ("model.fp8=false", 'model.expert_weight_format="mxfp4_qat"', "model.overrides.n_layers=3",
                 "model.overrides.n_dense_layers=3", "model.overrides.n_mtp_layers=0", "parallel.pp=1",
                 "parallel.dp=1", "parallel.ep=1", 'parallel.schedule="none"'):
        argv += ["--set", item]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "this model has none" in err and len(err.splitlines()) == 1, err


def test_config_takes_mxfp4_qat_with_blockwise_fp8():
    cfg = load_config(None, ['model.expert_weight_format="mxfp4_qat"', "model.fp8=true"])
    assert (cfg.model.fp8_recipe, cfg.model.expert_weight_format) == ("blockwise", "mxfp4_qat")


COMMON = ["run.sample_tokens=0", "data.seq_len=32", "data.global_batch=8", "data.micro_batch=1",
          "logging.progress=false", "logging.eval_batches=0", "logging.wandb=disabled", "logging.plot=false",
          "run.threads=1", "model.overrides.n_mtp_layers=0", "optim.warmup_steps=2", "checkpoint.final=false",
          "checkpoint.interval=0", "run.timeout_s=200", "model.fp8=true", "run.steps=3"]
ONE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]
DUALPIPEV = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=dualpipev", "parallel.zero1=true"]


def _train(run_dir: Path, layout: list[str], extra: list[str]) -> dict[int, float]:
    nproc = 1
    for kv in layout:
        if kv.split("=")[0] in ("parallel.pp", "parallel.dp"):
            nproc *= int(kv.split("=")[1])
    rows = train_cli("recipes/configs/tiny_cpu.toml", COMMON, run_dir, nproc, extra + layout)
    return {int(r["step"]): r["loss"] for r in rows if "loss" in r}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_blockwise_qat_dualpipev_ep_equals_one_process(tmp_path):
    """``recipes.train`` with MXFP4 QAT experts under blockwise FP8 on DualPipeV x EP2 x ZeRO-1 (4 gloo ranks)
    against one process, with test_combinations' FP8 tolerances and their derivation: step 1's forward quantises the
    same values on both sides (each rank's micro-batch is one of the reference's, the FP4 weights come from the
    same master weights), so its loss keeps the reordering bound LOSS_ATOL; the backward's FP8 casts see other
    scalings per rank, so later steps are held to FP8_LOSS_ATOL = |g . dw| <= 0.125 lr ||g||^2. An FP4 rounding
    flipped by the master weights' ~1e-7 reordering difference moves a loss by ~1e-4 (test_muon_dist), well inside.
    The one-process run without QAT differs at step 1 by more than LOSS_ATOL: the check can fail."""
    qat = ['model.expert_weight_format="mxfp4_qat"', 'optim.name="adamw"']
    four = _train(tmp_path / "four", DUALPIPEV, qat)
    one = _train(tmp_path / "one", ONE, qat)
    assert sorted(four) == sorted(one) == [1, 2, 3], (four, one)
    assert abs(four[1] - one[1]) <= LOSS_ATOL, (four, one)
    assert all(abs(four[s] - one[s]) <= FP8_LOSS_ATOL for s in (2, 3)), (four, one)
    plain = _train(tmp_path / "plain", ONE, ['optim.name="adamw"'])
    assert abs(plain[1] - one[1]) > LOSS_ATOL, (plain, one)


V4_CONFIG = "recipes/configs/v4_tiny_cpu.toml"
# DeepSeek-V4's training precision, as a user switches it on: Muon, MXFP4 QAT experts, the FP4 indexer (its head dim
# a multiple of 32); FP8 health every step so the report is in each record
V4_KEYS = ['optim.name="muon"', "optim.muon_lr=3e-3", 'model.expert_weight_format="mxfp4_qat"',
           'model.indexer_qk_format="mxfp4_hadamard"', "model.overrides.index_head_dim=32",
           "logging.fp8_health_every=1"]
V4_QUICK = ["run.steps=3", "run.sample_tokens=0", "data.seq_len=64", "data.global_batch=16", "data.micro_batch=2",
            "logging.progress=false", "logging.eval_batches=0", "logging.wandb=disabled", "run.threads=1",
            "optim.warmup_steps=2", "checkpoint.interval=0", "checkpoint.final=false"]


def _train_v4(run_dir: Path, nproc: int, extra: list[str]) -> list[dict]:
    return [r for r in train_cli(V4_CONFIG, V4_QUICK, run_dir, nproc, V4_KEYS + extra) if "loss" in r]


def _v4_health_covers_every_fp4_cast(rows: list[dict]) -> None:
    """Each record's FP8 health report holds every routed expert weight's MXFP4 cast (four layers and the MTP
    block, ``fwd.w``) and both CSA indexers' q and k casts (``fwd.q``, ``fwd.k``)."""
    experts = {f"{b}.ffn.experts.{w}" for b in ("layers.0", "layers.1", "layers.2", "layers.3", "mtp.0")
               for w in ("w13", "w2")}
    for r in rows:
        health = r["fp8_health"]
        assert set(health) == experts | {"layers.1.attn.indexer", "layers.3.attn.indexer"}, sorted(health)
        assert all(set(health[k]) == {"fwd.w"} for k in experts)
        assert all(set(health[f"layers.{i}.attn.indexer"]) == {"fwd.q", "fwd.k"} for i in (1, 3))
        assert 0 < r["fp8_fwd_underflow_max"] < 1


V4_SINGLE = ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_v4_trains_with_muon_and_fp4_from_the_cli(tmp_path):
    """A DeepSeek-V4 run switched to V4's precision by its keys (Muon, MXFP4 QAT experts, the FP4 indexer) trains in
    one process from a fresh model's ln 256, and its FP8 health report covers every FP4 cast."""
    rows = _train_v4(tmp_path / "one", 1, V4_SINGLE)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == pytest.approx(math.log(256), abs=0.15) and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    _v4_health_covers_every_fp4_cast(rows)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not os.environ.get("DSV3_V4_MUON_FP4"), reason="~1-2 min on 2 cores: set DSV3_V4_MUON_FP4=1")
def test_v4_demo_layout_with_muon_and_fp4_equals_one_process(tmp_path):
    """The V4 demo layout (DualPipeV x EP2 x ZeRO-1, 4 gloo ranks) with Muon, MXFP4 QAT experts and the FP4 indexer
    against one process (opt-in: ``DSV3_V4_MUON_FP4=1``). Tolerance (test_muon_dist's derivation): the ranks sum in
    another order (~1e-7 relative), which leaves step 1's loss within its reordering bound STEP1_ATOL; each update
    after it may flip a bf16 rounding in Newton-Schulz or an FP4 rounding of a weight (~1e-4 of the loss per
    update, LOSS_ATOL), so step s is held to (s - 1) x LOSS_ATOL. The health report covers every cast on both."""
    four = _train_v4(tmp_path / "four", 4, [])
    one = _train_v4(tmp_path / "one", 1, V4_SINGLE)
    assert [r["step"] for r in four] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(four, one):
        step = a["step"]
        assert abs(a["loss"] - b["loss"]) <= (STEP1_ATOL if step == 1 else (step - 1) * MUON_LOSS_ATOL), (four, one)
    _v4_health_covers_every_fp4_cast(four)
