"""DeepSeek-V3 on a GPU with the compiled kernels (deep_gemm / flash_mla Triton paths), against the
same model in fp32 on the CPU. Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import registry
from models.deepseek_v3 import ModelArgs, Transformer, lm_losses
from models.deepseek_v3.generate import LatentKVCache, forward_cached
from tests.test_model import randomize

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

# kernel-friendly debug shapes: 128-multiples where deep_gemm wants them, FlashMLA's 512+64 latent
ARGS = ModelArgs.preset("debug", dim=256, inter_dim=512, moe_inter_dim=128, n_heads=4, q_lora_rank=128,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _bf16_on_gpu(model: Transformer) -> Transformer:
    model = model.to(accel.default_device(), torch.bfloat16)
    for m in model.modules():
        bias = getattr(m, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            m.e_score_correction_bias = bias.float()
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def test_gpu_bf16_forward_and_absorbed_decode_match_cpu_fp32():
    ref = randomize(Transformer(ARGS)).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 96))
    with torch.no_grad():
        want = ref(tokens)
    import copy

    model = _bf16_on_gpu(copy.deepcopy(ref)).eval()
    gpu_tokens = tokens.to(accel.default_device())
    with registry.force("triton"), torch.no_grad():
        got = model(gpu_tokens)
        cache = LatentKVCache(model, 2, 100)
        steps = [forward_cached(model, gpu_tokens[:, :80], cache, 0)]
        steps += [forward_cached(model, gpu_tokens[:, i:i + 1], cache, i) for i in range(80, 96)]
    # bf16 weights and activations vs fp32: ~1e-2 relative on logits; 5e-2 catches layout/mask errors (O(1))
    assert _rel(got, want) < 5e-2
    assert _rel(torch.cat(steps, 1), want) < 5e-2


def test_gpu_fp8_training_step():
    import copy

    torch.manual_seed(0)
    ref = randomize(Transformer(ARGS))
    fp8 = Transformer(ARGS.replace(fp8=True))
    fp8.load_state_dict(ref.state_dict())
    bf16 = _bf16_on_gpu(copy.deepcopy(ref)).train()
    model = _bf16_on_gpu(fp8).train()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 129), device=accel.default_device())
    with registry.force("triton"):
        with torch.no_grad():
            want = bf16(tokens[:, :-1])
        logits, mtp = model.forward_with_mtp(tokens[:, :-1])
        out = lm_losses(ARGS, logits, mtp, tokens[:, 1:])
        out["loss"].backward()
    # FP8 (e4m3, 1x128 activation / 128x128 weight scales) vs the same model in bf16: measured 10% relative
    # with the CPU references, FP8 noise flipping a few top-k routing decisions amplifying the GEMM error;
    # 0.2 still fails for a wrong scale or layout (O(1) errors)
    assert _rel(logits, want) < 0.2
    assert torch.isfinite(out["loss"]) and abs(out["main"].item() - 5.55) < 0.5  # ~ln 256 at init
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters())) and all(torch.isfinite(g).all() for g in grads)
