"""The training criterion: next-token and MTP losses on the last pipeline stage, built once per step.

``StageLoss(stage, mtp_lambda)`` is called by the pipeline (or the trainer) once per micro-batch with
the last hidden state and the token windows (the model's ``lm_losses_from_hidden``: final norm, head
and MTP, without materialising the logits); it returns the micro-batch's total loss and keeps its
parts (``parts``: main, MTP per depth, tokens) for the caller to read after the step. The load
balancing losses ride on the MoE activations (``balancing.attach_aux_loss``) and are reported by the
balancers. Losses are unscaled: the trainer divides the gradients by the number of micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.deepseek_v3.model import lm_losses_from_hidden_steps
from models.deepseek_v3.steps import Steps, drain
from training.stages import DeepSeekV3Stage, cuts_of, mark_loss


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
        return drain(self.steps(h, windows))

    def steps(self, h: torch.Tensor, windows: torch.Tensor) -> Steps[torch.Tensor]:
        """``__call__`` as steps: the MTP blocks yield while their all-to-alls travel, so a pipeline hides them
        behind another micro-batch; their exchanges join the stage's (``cuts_of(h)``) for the backward."""
        st = self.stage
        tokens, labels = windows[:, :-1], windows[:, 1:]
        parts = yield from lm_losses_from_hidden_steps(self.args, st.norm, st.head, st.mtp, st.embed, h, tokens,
                                                       labels, cuts=cuts_of(h))
        loss, main = parts["loss"], parts["main"]
        if self.inject_nan:  # as a bad batch would: the reported loss and, through backward, every gradient
            loss, main = loss * float("nan"), main * float("nan")
        self.parts.append(LossParts(float(loss.detach()), float(main.detach()),
                                    [float(m.detach()) for m in parts["mtp"]], labels.numel()))
        return mark_loss(loss, h)

    def mean(self, name: str) -> float | None:
        """Mean over this step's micro-batches of ``total``, ``main`` or ``mtp`` (itself the mean over depths);
        None when there is none."""
        if name == "mtp":
            values = [sum(p.mtp) / len(p.mtp) for p in self.parts if p.mtp]
        else:
            values = [getattr(p, name) for p in self.parts]
        return sum(values) / len(values) if values else None
