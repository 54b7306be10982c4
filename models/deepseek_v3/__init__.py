"""The DeepSeek-V3 model: MLA, DeepSeekMoE, MTP, HF-compatible checkpoints, KV-cache generation.

Public names follow DeepSeek's ``inference/model.py``::

    from models.deepseek_v3 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
"""

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v3.model import Block, Transformer, lm_losses, lm_losses_from_hidden
from models.deepseek_v3.moe import MoE, Routing

__all__ = ["Block", "ModelArgs", "MoE", "Routing", "Transformer", "lm_losses", "lm_losses_from_hidden",
           "load_hf_checkpoint", "save_hf_checkpoint"]
