"""The training criterion: next-token and MTP losses on the last pipeline stage, built once per step.

``StageLoss(stage, mtp_lambda)`` is called by the pipeline (or the trainer) once per micro-batch with
the last hidden state and the token windows (the model's ``lm_losses_from_hidden``: final norm, head
and MTP, without materialising the logits); it returns the micro-batch's total loss and keeps its
parts (``parts``: main, MTP per depth, tokens) for the caller to read after the step. The overlapped
pipeline runs the same as plan pieces (``pieces``). The load balancing losses ride on the MoE
activations (``balancing.attach_aux_loss``) and are reported by the balancers. Losses are unscaled:
the trainer divides the gradients by the number of micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.deepseek_v3.model import head_losses, lm_losses_from_hidden
from models.deepseek_v3.mtp import mtp_pieces
from models.deepseek_v3.plan import Compute, Piece
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
        return self._total(lm_losses_from_hidden(self.args, st.norm, st.head, st.mtp, st.embed, h, tokens, labels),
                           labels)

    def pieces(self, windows: torch.Tensor) -> list[Piece]:
        """The same as plan pieces after the stage's (which end in ``h``): the MTP depths (whose all-to-alls the
        overlapped pipeline hides), then the heads, ending in ``loss``."""
        st = self.stage
        tokens, labels = windows[:, :-1], windows[:, 1:]
        pieces, hidden = mtp_pieces(self.args, st.mtp, st.embed, tokens)

        def loss(h: torch.Tensor, *mtp_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
            parts = head_losses(self.args, st.norm, st.head, st.mtp, h, mtp_hidden, labels)
            return {"loss": self._total(parts, labels)}

        return [*pieces, Compute("loss", loss, ("h", *hidden), ("loss",))]

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
