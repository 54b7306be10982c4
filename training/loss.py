"""The training criterion: next-token and MTP losses on the last pipeline stage, built once per step.

``StageLoss(stage, mtp_lambda)`` is called by the pipeline (or the trainer) once per micro-batch with
the last hidden state and the token windows (the model's ``lm_losses_from_hidden``: final norm, head
and MTP, without materialising the logits); it returns the micro-batch's total loss and keeps its
parts (``parts``: main, MTP per depth, tokens) for the caller to read after the step. The overlapped
pipeline runs the same as plan pieces (``pieces``). The load balancing losses ride on the MoE
activations (``balancing.attach_aux_loss``) and are reported by the balancers; so does DeepSeek-V3.2's
indexer loss on each attention output (``models.deepseek_v3.indexer``), reported by ``indexer_metrics``.
``freeze_all_but_indexers`` makes the dense warm-up train the indexers alone, and ``init_from_hf`` starts
a run from an HF checkpoint (a V3 one for a V3.2 run). Losses are unscaled: the trainer divides the
gradients by the number of micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from models.deepseek_v3 import ModelArgs
from models.deepseek_v3.checkpoint import load_hf_checkpoint
from models.deepseek_v3.indexer import Indexer, IndexerStats
from models.deepseek_v3.model import Transformer
from models.deepseek_v3.plan import Compute, Piece
from models.deepseek_v4 import ModelArgs as V4Args
from models.deepseek_v4 import Transformer as V4Transformer
from models.deepseek_v4 import load_hf_checkpoint as load_v4_checkpoint
from models.deepseek_v4.model import Indexer as V4Indexer
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


@dataclass
class LossParts:
    """One micro-batch's loss, detached: the total (what backward starts from), the next-token loss, each
    MTP depth's, and the tokens they average."""

    total: float
    main: float
    mtp: list[float]
    tokens: int


class StageLoss:
    """``criterion(h, windows) -> loss`` for the last stage ``stage``; ``parts`` collects each call's parts."""

    def __init__(self, stage: DeepSeekV3Stage, mtp_lambda: float, inject_nan: bool = False):
        """``inject_nan``: every loss of this step is NaN (``fault.inject_nan_at_step``, to check the guard)."""
        if not stage.is_last:
            raise ValueError(f"StageLoss needs the last pipeline stage, got stage {stage.stage_id}")
        self.stage = stage
        self.args = stage.args if mtp_lambda == stage.args.mtp_loss_weight else stage.args.replace(
            mtp_loss_weight=mtp_lambda)
        self.parts: list[LossParts] = []
        self.inject_nan = inject_nan

    def __call__(self, h: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch from the last hidden state ``h [b, s, dim]`` and its windows ``[b, s + 1]``."""
        st = self.stage
        tokens, labels = windows[:, :-1], windows[:, 1:]
        with st.applied():
            parts = st.lm_losses(self.args, h, tokens, labels, positions=self._positions(h))
        return self._total(parts, labels)

    def _positions(self, h: torch.Tensor) -> torch.Tensor | None:
        """The global positions of ``h``'s rows under context parallelism (the windows are then whole
        sequences, ``h`` this rank's chunks of them); None without."""
        return None if self.stage.cp is None else self.stage.positions(h.shape[1], h.device)

    def pieces(self, windows: torch.Tensor) -> list[Piece]:
        """The same as plan pieces after the stage's (which end in ``h``): the MTP depths (whose all-to-alls the
        overlapped pipeline hides), then the heads, ending in ``loss``."""
        st = self.stage
        tokens, labels = windows[:, :-1], windows[:, 1:]
        positions = None if st.cp is None else st.cp.positions(windows.device)
        pieces, hidden, losses = st.loss_pieces(self.args, tokens, labels, positions)

        def loss(h: torch.Tensor, *mtp_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self._total(losses(h, *mtp_hidden), labels)}

        return st.under_policy([*pieces, Compute("loss", loss, ("h", *hidden), ("loss",))])

    def _total(self, parts: dict, labels: torch.Tensor) -> torch.Tensor:
        loss, main = parts["loss"], parts["main"]
        if self.inject_nan:  # as a bad batch would: the reported loss and, through backward, every gradient
            loss, main = loss * float("nan"), main * float("nan")
        self.parts.append(LossParts(float(loss.detach()), float(main.detach()),
                                    [float(m.detach()) for m in parts["mtp"]], labels.numel()))
        return loss

    def mean(self, name: str) -> float | None:
        """Mean over this step's micro-batches of ``total``, ``main`` or ``mtp`` (itself the mean over depths);
        None when there is none."""
        if name == "mtp":
            values = [sum(p.mtp) / len(p.mtp) for p in self.parts if p.mtp]
        else:
            values = [getattr(p, name) for p in self.parts]
        return sum(values) / len(values) if values else None


def freeze_all_but_indexers(modules: Sequence[nn.Module]) -> int:
    """DSA's dense warm-up: every parameter outside a lightning indexer stops requiring grad (the optimizer then
    never sees it). Returns the number of indexer parameters left trainable; ValueError when there is none."""
    indexers = [sub for m in modules for sub in m.modules() if isinstance(sub, (Indexer, V4Indexer))]
    indexer_params = {id(p) for sub in indexers for p in sub.parameters()}
    for m in modules:
        for p in m.parameters():
            p.requires_grad_(id(p) in indexer_params)
    if not indexer_params and any(True for m in modules for _ in m.parameters()):
        raise ValueError("model.overrides.dsa_warmup=true, but this rank's layers hold no indexer (index_topk = 0, or "
                         "no V4 CSA layer)")
    return len(indexer_params)


def init_from_hf(model: Transformer | V4Transformer, path: str | Path) -> None:
    """Load this rank's materialised part of ``model`` from the HF checkpoint folder ``path`` (model.init_from).
    A checkpoint without indexer weights (DeepSeek-V3) leaves a V3.2 model's indexers as initialised. A V4 model
    reads a V4 folder in either layout (transformers' or DeepSeek's release, FP8 / MXFP4 dequantised)."""
    path = Path(path).expanduser()
    try:
        if isinstance(model, V4Transformer):
            V4Args.from_hf_config(path)  # a readable V4 config.json; the tensors' names and shapes are checked
            load_v4_checkpoint(model, path)
            return
        saved = ModelArgs.from_hf_config(path)
        load_hf_checkpoint(model, path, fresh_indexer=bool(model.args.index_topk) and not saved.index_topk)
    except ValueError as exc:
        raise ValueError(f"model.init_from={str(path)!r}: {exc}") from None


@torch.no_grad()
def indexer_metrics(modules: Sequence[nn.Module], ps: ParallelState, device: torch.device) -> dict[str, float]:
    """``indexer_kl`` (and ``indexer_recall`` in the warm-up: the share of the main attention's top-k keys the
    indexer's top-k holds) since the last call: mean over this rank's layers, then over the ranks holding
    layers. Collective on every rank (world all-reduce), whether or not it holds layers."""
    stats = [m for mod in modules for m in mod.modules() if isinstance(m, IndexerStats)]
    names = ("kl", "recall")
    sums = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
    for s in stats:
        for name, value in s.metrics(reset=True).items():
            j = names.index(name)
            sums[2 * j] += value
            sums[2 * j + 1] += 1
    if ps.world_size > 1:
        dist.all_reduce(sums)
    return {f"indexer_{name}": float(sums[2 * j] / sums[2 * j + 1]) for j, name in enumerate(names)
            if sums[2 * j + 1] > 0}
