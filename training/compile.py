"""``run.compile``: ``torch.compile(fullgraph=True)`` applied to this rank's model from outside, per block.

As torchtitan's ``parallelize`` does, the model is not told: each module to compile gets ``nn.Module.compile``
(its ``__call__`` runs compiled; names, parameters and state dicts are unchanged). What is compiled:

- every ``Block`` without expert parallelism, whole (attention, its FFN or single-rank MoE): the plain layer loop,
  the plan's one-piece layers and the MTP blocks all call it;
- in an expert-parallel ``Block`` the modules between its all-to-alls (the attention and FFN norms, MLA, the
  shared experts, the local routed experts): the all-to-alls, the routing and the rows' permutation around them
  (host-read split sizes) stay eager, so the plan's pieces cut at the same places and every exchange is posted
  as before, never from inside a compiled region;
- the MTP depths' input norms and projection, and the final and MTP head norms (the loss's fused head runs on them).

Only training is compiled: ``eager()`` is the context the trainer runs evaluation, sampling and the FP8 shadow
check in (no-grad passes, a generation's latent cache). ``tracing()`` is dynamo's configuration for tracing this
model: the MoE's grouped layout has a data-dependent row count, captured as an unbacked size.

What cannot compile is refused at launch (``check_compile``), never run eager in silence. Recompute of any kind
and the FP8 SwiGLU cache are eager saved-tensor hooks (``torch.utils.checkpoint``, ``training.memory_policy``), and
a compiled region run under saved-tensor hooks gets, in its backward, stand-ins of the weights (AOTAutograd packs
its graph inputs through the hooks) instead of the parameters, so the GEMM ops' weight gradients, accumulated
outside autograd into the parameter they are handed (``deep_gemm.linear``), would silently go nowhere (measured:
every weight gradient of a recomputed block was zero). So ``run.compile`` takes no ``model.overrides.recompute``
(what a compiled backward keeps is its partitioner's choice) and no ``fp8_cache_activations``, the memory policy is
not installed, and the FP8 health report (Python observing each cast) stays off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.block import Block
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.mtp import MTPModule


def check_compile(args: ModelArgs, fp8_health_every: int, inject_fp8_scale_error: bool) -> None:
    """ValueError naming the keys when ``run.compile = true`` cannot compile this model as configured.
    ``fp8_health_every``: ``logging.fp8_health_every`` where the run has FP8 / FP4 casts, else 0."""
    if args.recompute_kinds:
        raise ValueError(f"run.compile=true with model.overrides.recompute={list(args.recompute)}: recompute runs "
                         "under eager saved-tensor hooks (torch.utils.checkpoint, the memory policy), which hand a "
                         "compiled backward stand-ins of the weights, so the GEMMs' weight gradients would be lost; "
                         "set model.overrides.recompute=[] (the compiler then chooses what backward keeps) or "
                         "run.compile=false")
    if args.fp8 and args.fp8_cache:
        raise ValueError("run.compile=true with model.fp8=true and FP8 activation caching: the SwiGLU input's FP8 "
                         "cast is an eager saved-tensor hook; set model.overrides.fp8_cache_activations=false or "
                         "run.compile=false")
    if fp8_health_every:
        raise ValueError(f"run.compile=true with FP8 / FP4 casts and logging.fp8_health_every={fp8_health_every}: "
                         "the FP8 health report observes the casts from Python; set logging.fp8_health_every=0 "
                         "or run.compile=false")
    if inject_fp8_scale_error:
        raise ValueError("run.compile=true with fault.inject_fp8_scale_error_at_step: the fault is a forward hook "
                         "reading the step; set run.compile=false for that test")


def compiled_modules(stages: Iterable[nn.Module]) -> Iterator[nn.Module]:
    """The modules ``compile_stages`` compiles, each once (see the module docstring)."""
    seen: set[int] = set()
    for stage in stages:
        for m in stage.modules():
            if isinstance(m, Block):
                parts: list[nn.Module | None] = [m]
                if m.expert_parallel:
                    moe: MoE = m.ffn
                    parts = [m.attn_norm, m.attn, m.ffn_norm, moe.shared_experts, moe.experts]
            elif isinstance(m, MTPModule):
                parts = [m.enorm, m.hnorm, m.eh_proj, m.norm]
            else:
                continue
            for part in parts:
                if part is not None and id(part) not in seen:
                    seen.add(id(part))
                    yield part
        norm = getattr(stage, "norm", None)
        if norm is not None and id(norm) not in seen:
            seen.add(id(norm))
            yield norm


def compile_stages(stages: Iterable[nn.Module], backend: str) -> int:
    """Compile this rank's stages' modules in place with ``backend``; returns how many modules."""
    n = 0
    for m in compiled_modules(stages):
        m.compile(fullgraph=True, backend=backend)
        n += 1
    return n


def tracing() -> contextlib.AbstractContextManager:
    """Dynamo's settings while it traces the model: data-dependent sizes (the MoE's grouped rows) and ``.item()``
    reads become unbacked symbols in the graph instead of graph breaks."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def eager() -> contextlib.AbstractContextManager:
    """Compiled modules run their eager forward inside this (evaluation, sampling: no-grad passes)."""
    return torch.compiler.set_stance("force_eager")


__all__ = ["check_compile", "compile_stages", "compiled_modules", "eager", "tracing"]
