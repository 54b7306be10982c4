"""``model.init_from`` for DeepSeek-V4 (issue 37 item 5): an HF folder in transformers' layout or DeepSeek's released
layout (FP8 + UE8M0, MXFP4) loads into each training rank's V4 stages and its expert-parallel slice of the routed
experts: every materialised tensor takes the checkpoint's values, the other stages stay on meta; a loaded one-stage
build gives the saved model's logits. A run through the CLI from such a folder: ``test_v4_training_slow.py``."""

from __future__ import annotations

import pytest
import torch

from models.deepseek_v4 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
from training.loss import init_from_hf
from training.stages import build_stages

ARGS = dict(vocab_size=256, max_seq_len=256, dim=64, n_heads=8, moe_inter_dim=32, head_dim=32, q_lora_rank=32,
            index_head_dim=32)


def _saved(tmp_path, layout: str, quantize: bool) -> tuple[Transformer, str]:
    """A randomised debug V4 (MTP included) saved as ``layout``; returns the values the folder decodes to."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.preset("debug_v4", **ARGS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith(("attn_sink", "ape", "_base")) else 0.1)
    folder = tmp_path / f"{layout}{'_q' * quantize}"
    save_hf_checkpoint(model, folder, layout=layout, quantize=quantize)
    # what the folder holds (a quantised save rounds the FP8 / MXFP4 weights): the whole model loaded plainly
    return load_hf_checkpoint(ModelArgs.preset("debug_v4", **ARGS), folder), str(folder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, quantize", [("transformers", False), ("release", True)])
def test_each_rank_loads_its_stages_and_expert_slice(tmp_path, layout, quantize):
    whole, folder = _saved(tmp_path, layout, quantize)
    ref = dict(whole.named_parameters()) | dict(whole.named_buffers())
    args = ModelArgs.preset("debug_v4", **ARGS)
    per = args.n_routed_experts // 2
    for pp_rank in (0, 1):
        for ep_rank in (0, 1):
            model, _ = build_stages(args, "dualpipev", 2, pp_rank, ep_rank, 2, torch.device("cpu"), torch.float32, 3)
            init_from_hf(model, folder)
            loaded = 0
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if t.is_meta:
                    continue
                want = ref[name][ep_rank * per:(ep_rank + 1) * per] if ".experts." in name else ref[name]
                assert torch.equal(t, want), (pp_rank, ep_rank, name)
                loaded += 1
            assert loaded > 0


@pytest.mark.timeout(120)
def test_a_loaded_one_stage_build_gives_the_saved_models_logits(tmp_path):
    whole, folder = _saved(tmp_path, "transformers", False)
    args = ModelArgs.preset("debug_v4", **ARGS)
    model, _ = build_stages(args, "none", 1, 0, 0, 1, torch.device("cpu"), torch.float32, 5)
    init_from_hf(model, folder)
    tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), whole.eval()(tokens))


def test_a_missing_expert_is_named_in_one_line(tmp_path):
    whole, folder = _saved(tmp_path, "release", False)
    args = ModelArgs.preset("debug_v4", **ARGS, n_routed_experts=2 * ModelArgs.preset("debug_v4").n_routed_experts)
    model, _ = build_stages(args, "none", 1, 0, 0, 1, torch.device("cpu"), torch.float32, 5)
    with pytest.raises(ValueError, match=r"model.init_from=.*missing.*ffn\.experts\.\d+\.w"):
        init_from_hf(model, folder)
