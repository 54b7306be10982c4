"""The per-rank memory model (``planner.memory``) and the optimizer options it counts (BF16 moments, host EMA)."""

from __future__ import annotations

import math

import pytest
import torch

from planner import memory_measure
from planner.memory import GiB, estimate, format_estimate
from planner.memory_measure import LiveBytes
from training.config import load_config
from training.optim import AdamW, optimizer_spec
from training.trainer import model_args

CONFIG_671B = "recipes/configs/deepseek_v3_671b.toml"


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 19, generator=g, dtype=dtype), torch.randn(300, generator=g, dtype=dtype),
            torch.randn(5, 3, 2, generator=g, dtype=dtype)]


def _run(opt_params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step in grads:
        for p, g in zip(opt_params, step):
            p.grad = g.clone()
        opt.step()


def _grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params] for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_with_full_precision_moments_is_torch_adamw_bitwise(dtype, monkeypatch):
    """Same operations in the same order as ``torch.optim.AdamW`` (also across the chunk boundary)."""
    import training.optim

    monkeypatch.setattr(training.optim, "STEP_CHUNK", 64)  # several chunks per tensor
    ref = [p.clone().requires_grad_() for p in _params(dtype)]
    ours = [p.clone().requires_grad_() for p in _params(dtype)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    grads = _grads(ref, 6)
    _run(ref, torch.optim.AdamW(ref, **kw), grads)
    _run(ours, AdamW(ours, moments_dtype=None, **kw), grads)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))


def test_bf16_moments_are_stored_in_bf16_and_track_fp32_adamw():
    """Moments rounded to bf16 (8 mantissa bits: relative error <= 2^-9 per store) change each update
    ``lr * m / (sqrt(v) + eps)`` by a relative ~2^-8; over n steps the weights drift by at most
    ``n * lr * 2^-6`` (4x headroom) from fp32-moment AdamW, and the drift is not zero (the rounding is real)."""
    lr, steps = 1e-2, 20
    ref = [p.clone().requires_grad_() for p in _params(torch.float32)]
    ours = [p.clone().requires_grad_() for p in _params(torch.float32)]
    grads = _grads(ref, steps)
    opt = AdamW(ours, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    _run(ref, torch.optim.AdamW(ref, lr=lr, betas=(0.9, 0.95), weight_decay=0.1), grads)
    _run(ours, opt, grads)
    assert all(s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
               for s in opt.state.values())
    drift = max(float((a - b).detach().abs().max()) for a, b in zip(ref, ours))
    assert 0 < drift <= steps * lr * 2**-6


def test_bf16_moments_resume_bit_exactly():
    """state_dict -> a fresh optimizer (torch's load casts states to the parameter dtype; ours casts back:
    bf16 -> fp32 -> bf16 is exact) -> the same weights as an uninterrupted run, bit for bit."""
    grads = _grads(_params(torch.float32), 8)
    full = [p.clone().requires_grad_() for p in _params(torch.float32)]
    _run(full, AdamW(full, lr=1e-2, ema_decay=0.9), grads)
    part = [p.clone().requires_grad_() for p in _params(torch.float32)]
    first = AdamW(part, lr=1e-2, ema_decay=0.9)
    _run(part, first, grads[:5])
    saved = first.state_dict()
    resumed = [p.detach().clone().requires_grad_() for p in part]
    second = AdamW(resumed, lr=1e-2, ema_decay=0.9)
    second.load_state_dict(saved)
    assert all(s["exp_avg"].dtype == torch.bfloat16 and s["ema"].device.type == "cpu" for s in second.state.values())
    _run(resumed, second, grads[5:])
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


def test_host_ema_follows_the_float64_recurrence():
    """EMA_t = d EMA_{t-1} + (1 - d) w_t from the first update's weights, on the host, applied on a worker thread."""
    decay = 0.8
    params = [p.clone().requires_grad_() for p in _params(torch.float32)]
    opt = AdamW(params, lr=1e-2, moments_dtype=None, ema_decay=decay)
    expected = None
    for step in _grads(params, 5):
        _run(params, opt, [step])
        w = [p.detach().double().clone() for p in params]
        expected = w if expected is None else [decay * e + (1 - decay) * x for e, x in zip(expected, w)]
    ema = opt.ema_state()
    for p, e in zip(params, expected):
        assert ema[p].device.type == "cpu"
        # fp32 lerp of O(1) values, 5 steps: a few fp32 ulps
        torch.testing.assert_close(ema[p].double(), e, rtol=0, atol=1e-6)


def test_optimizer_options_fail_with_the_key_named():
    with pytest.raises(ValueError, match="optim.moments_dtype='bfloat16' needs optim.name='adamw'"):
        load_config(None, ["optim.name=\"sgd\"", "optim.moments_dtype=\"bfloat16\""])
    with pytest.raises(ValueError, match="optim.moments_dtype must be one of param, bfloat16"):
        load_config(None, ["optim.moments_dtype=\"fp8\""])
    with pytest.raises(ValueError, match="optim.ema_decay"):
        load_config(None, ["optim.ema_decay=1.5"])
    with pytest.raises(ValueError, match="optim.name must be one of adamw, muon, sgd"):
        load_config(None, ["optim.name=\"lion\""])
    cls, kw = optimizer_spec(load_config(None, ["optim.moments_dtype=\"bfloat16\""]).optim)
    assert cls is AdamW and kw["moments_dtype"] == torch.bfloat16
    assert optimizer_spec(load_config(None).optim)[0] is torch.optim.AdamW


def test_estimate_public_api_and_verdict():
    """What a planner reads: per-rank items in bytes, the device's capacity, fits, and a verdict naming items."""
    cfg = load_config(CONFIG_671B)
    est = estimate(cfg, device="H800")
    assert est.device == "H800" and est.capacity_bytes == int(79.6 * GiB)
    assert len(est) == cfg.parallel.pp
    for r in est:
        assert set(r.items) == {"weights", "gradients", "optimizer", "activations", "transient", "comm", "margin"}
        assert r.total_bytes == sum(r.items.values()) and r.peak_microbatches == cfg.parallel.pp + 1  # DualPipe
    text = format_estimate(cfg, model_args(cfg), est)
    assert "device: H800 (79.6 GiB)" in text and "verdict: " in text
    assert est.fits is (est.peak_bytes <= est.capacity_bytes)
    assert ("FITS" in est.verdict()) is est.fits
    with pytest.raises(ValueError, match="--device 'Z9000': unknown device"):
        estimate(cfg, device="Z9000")


def test_bf16_moments_halve_the_optimizer_item_and_ema_lives_on_the_host():
    fp32 = ["run.dtype=\"float32\"", "optim.master_dtype=\"param\""]  # the parameters are the fp32 masters
    base = estimate(load_config(CONFIG_671B, fp32 + ["optim.moments_dtype=\"param\"", "optim.ema_decay=0"]),
                    device="H800")
    cfg = load_config(CONFIG_671B, fp32 + ["optim.moments_dtype=\"bfloat16\"", "optim.ema_decay=0.999"])
    v3 = estimate(cfg, device="H800")
    for a, b in zip(base, v3):
        assert b.items["optimizer"] * 2 == pytest.approx(a.items["optimizer"], rel=1e-9)
        # an fp32 EMA and an fp32 snapshot of the rank's ZeRO-1 shard: the size of two fp32 moments
        assert b.host["ema"] == pytest.approx(a.items["optimizer"], rel=1e-9)
        assert "ema" not in b.items
    assert math.isclose(sum(r.items["weights"] for r in v3), sum(r.items["weights"] for r in base))


@pytest.mark.timeout(300)
def test_trainer_checkpoint_resume_with_bf16_moments_and_ema_is_bit_exact(tmp_path):
    """Through the trainer's checkpoint hooks (the moments and the EMA live in the optimizer's state, saved by
    parameter name): stop at step 3, resume, and the losses, weights, BF16 moments and host EMA equal a straight
    run's bit for bit."""
    from tests.test_checkpoint_trainer import _cfg, _train

    extra = ["optim.moments_dtype=\"bfloat16\"", "optim.ema_decay=0.9"]
    straight, a = _train(tmp_path / "a", _cfg(5, extra))
    first, _ = _train(tmp_path / "b", _cfg(5, extra), stop_at=3)
    second, b = _train(tmp_path / "b", _cfg(5, extra), resume="auto")
    assert {**first, **second} == {k: v for k, v in straight.items() if k != 3}
    for pa, pb in zip(a.modules.parameters(), b.modules.parameters()):
        assert torch.equal(pa, pb)
    (oa,), (ob,) = a.optimizer.optimizers[:1], b.optimizer.optimizers[:1]
    for pa, pb in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"]):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sb["exp_avg"].dtype == torch.bfloat16 and torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        oa.wait_ema(), ob.wait_ema()
        assert sb["ema"].device.type == "cpu" and torch.equal(sa["ema"], sb["ema"])


# option sets whose saved tensors differ: each recompute kind, FP8 with and without caching, whole-block recompute
SAVED_OPTIONS = {
    "none": {}, "v3": {"recompute": ("v3",)}, "swiglu": {"recompute": ("swiglu",)},
    "fp8, no caching": {"fp8": True, "fp8_cache_activations": False},
    "fp8, no caching, swiglu": {"fp8": True, "fp8_cache_activations": False, "recompute": ("swiglu",)},
    "v3 + fp8 caching": {"fp8": True, "recompute": ("v3",)}, "block": {"recompute": ("block",)},
    "block + fp8 caching": {"fp8": True, "recompute": ("block",)},
}


def test_live_bytes_counts_storages_once_until_they_die():
    """Hand-counted: a view adds nothing, a freed storage leaves the count, the peak stays; storages made before the
    block are not counted."""
    before = torch.empty(1000)
    with LiveBytes() as m:
        a = torch.empty(100)  # 400 B
        v = a.view(10, 10)[1:]  # a view: same storage
        b = before + 1  # 4000 B
        assert m.live == 4400 and m.bytes_of([a, v, b]) == 4400
        del b
        assert m.live == 400
        del a
        assert m.live == 400  # the view keeps the storage
        del v
        assert m.live == 0 and m.peak == 4400
        m.mark()
        c = torch.empty(25)
        assert m.live == m.peak == 100
        del c


@pytest.mark.parametrize("name", ["none", "v3 + fp8 caching", "block"])
def test_meter_equals_the_cpu_allocator_and_meta_equals_real(name):
    """Ground truth on a CPU, debug model, 128 tokens, a dense and a MoE block: the meter's peak over forward +
    backward on real tensors is the c10 CPU allocator's (``recipes.memory_report.CpuPeak``) to 0.5% (the MoE's
    own host work allocates a little the dispatcher does not see), and the same block measured on ``meta``
    (``memory_measure.block``, balanced routing) keeps what the real run keeps to 256 bytes (the balancer's
    counters) with the same peak. Routing in the real run is not balanced, but every expert gets 1-128 rows,
    so the padded layout (one 128-row block per expert) is the same."""
    from accel import registry
    from accel.grads import keep_main_grads
    from models.deepseek_v3 import Block, ModelArgs
    from models.deepseek_v3.rope import rope_cos_sin
    from recipes.memory_report import CpuPeak
    from training.memory_policy import MemoryPolicy

    args = ModelArgs.preset("debug", **SAVED_OPTIONS[name])
    seq = 128
    cos, sin = rope_cos_sin(args, torch.arange(seq))
    for layer in (0, 1):
        torch.manual_seed(layer)
        block = Block(args, layer)
        with torch.no_grad():
            for w in block.parameters():
                w.normal_(std=0.3)
        keep_main_grads(list(block.parameters()))
        x = torch.randn(1, seq, args.dim, requires_grad=True)
        policy = MemoryPolicy(block, args)  # as the trainer applies it
        with policy.applied():
            out = policy.recomputed(block, block)(x, cos, sin)
        out.sum().backward()  # first-call allocations (caches) happen outside the count
        allocator = CpuPeak()
        with registry.force("reference"), allocator.measure(), LiveBytes() as meter:
            xc = x.clone()
            with policy.applied():
                out = policy.recomputed(block, block)(xc, cos, sin)
            del xc
            saved = meter.live - meter.bytes_of(out)
            out.backward(torch.ones_like(out))
            del out
        measured = memory_measure.block(args, layer, 1, seq, 4, False)
        assert abs(allocator.peak - meter.peak) <= 0.005 * allocator.peak, (name, layer, allocator.peak, meter.peak)
        assert abs(measured.saved - saved) <= 256, (name, layer, measured.saved, saved)
        assert abs(measured.saved + measured.transient + seq * args.dim * 4 - meter.peak) <= 256, (name, layer)


def test_one_more_saved_tensor_shows_in_the_estimate(monkeypatch):
    """The estimate follows the model's code: make the attention (``MLA.forward``) keep one more ``[tokens, dim]``
    fp32 tensor (``tanh`` saves its output) and every layer's measured bytes, so the rank's activations, grow by
    it."""
    from models.deepseek_v3.mla import MLA

    cfg = load_config("recipes/configs/tiny_cpu.toml", ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1",
                                                        "parallel.schedule=\"none\"", "data.global_batch=2",
                                                        "data.micro_batch=1"])
    args = model_args(cfg)
    memory_measure.cache_clear()
    before = estimate(cfg).ranks[0].items["activations"]
    original = MLA.forward

    def keeps_more(self, x, *rest, **kw):
        out = original(self, x, *rest, **kw)
        return out + (out * 0.5).tanh() * 0

    monkeypatch.setattr(MLA, "forward", keeps_more)
    memory_measure.cache_clear()
    after = estimate(cfg).ranks[0].items["activations"]
    memory_measure.cache_clear()
    tokens = cfg.data.seq_len * cfg.data.micro_batch
    blocks = args.n_layers + args.n_mtp_layers
    assert after - before == blocks * tokens * args.dim * 4


def test_measurement_patches_nothing_and_plans_for_hopper():
    """The GPU path's measurement runs the kernels' wrappers as on a Hopper GPU (FP8 tensor cores, 132 SMs) by
    passing the target (``accel.planning_for``), not by swapping torch's, Triton's or the project's functions:
    inside the piece every one of them is the object it was before, and afterwards the CPU answers again."""
    import triton.runtime.jit as triton_jit

    import accel
    import deep_gemm

    def objects():
        return (torch.UntypedStorage.resize_, torch.UntypedStorage.data_ptr, triton_jit.KernelInterface.__getitem__,
                accel.fp8_native, deep_gemm.utils._num_sms, deep_gemm.get_num_sms)

    before, seen = objects(), []

    def piece(x):
        seen.append((objects(), accel.fp8_native(), deep_gemm.get_num_sms(), accel.device_capability()))
        return (x * 2,)

    memory_measure.measure(piece, [torch.empty(4, 8, device="meta", requires_grad=True)], accelerator=True)
    assert seen == [(before, True, 132, (9, 0))]
    assert objects() == before
    assert accel.device_capability() is None and not accel.fp8_native() and deep_gemm.get_num_sms() == 1


def test_a_triton_launch_on_meta_tensors_runs_nothing():
    """``registry.wrap_triton(kernel)[grid](...)`` on meta tensors is a no-op (the wrapper's allocations are what
    the measurement counts); on a CPU without the interpreter a real launch would fail."""
    import triton
    import triton.language as tl

    from accel import registry

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    x = torch.empty(100, device="meta")
    assert registry.wrap_triton(double)[(1,)](x, 100, BLOCK=128) is None
