"""The DeepSeek-V4 model: hybrid compressed sparse attention (CSA / HCA), mHC residual streams, hash-routed and
scored MoE, MTP, checkpoints in transformers' and DeepSeek's released layouts.

Public names follow DeepSeek's ``inference/model.py``::

    from models.deepseek_v4 import ModelArgs, Transformer, load_hf_checkpoint, save_hf_checkpoint
"""

from models.deepseek_v4.args import ModelArgs
from models.deepseek_v4.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v4.model import Block, MoE, Transformer

__all__ = ["Block", "ModelArgs", "MoE", "Transformer", "load_hf_checkpoint", "save_hf_checkpoint"]
