"""DeepSeek-V4 for training: the layer loop, the per-layer plan pieces, MTP and the losses, as V3's are.

A V4 layer carries ``hc_mult`` residual streams ``[b, s, hc, dim]`` and needs the token ids (the first
``n_hash_layers`` route by them), so a stage's input is the streams and the tokens. The overlapped pipeline
(``models.deepseek_v3.plan``: ``Compute`` / ``Exchange`` pieces, ``Run``, ``overlapped``) runs an
expert-parallel V4 layer as five pieces, cut at the all-to-alls as V3's::

    attention  h, tokens -> h, send, plan, shared, post, comb    Block.attention, Block.ffn_pre (the MoE's mHC
                                                                 collapse and norm), then MoE.send
    dispatch   send -> rows                                      all-to-all
    experts    rows -> y                                         MoE.expert_rows
    combine    y -> back                                         all-to-all
    output     h, back, plan, shared, post, comb -> h            hc_post(MoE.combined(...), h, post, comb)

A layer without all-to-alls is one piece (``Block.run``). Whole-block recompute is the caller's ``wrap``
(``models.deepseek_v3.block.LayerWrap``, given by the trainer from ``recompute = ["block"]``): it wraps each compute
piece on its own, never an exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from models.deepseek_v3.block import LayerWrap
from models.deepseek_v3.model import head_loss
from models.deepseek_v3.plan import Compute, Exchange, Piece
from models.deepseek_v4.args import ModelArgs
from models.deepseek_v4.model import Block, HCHead, MTPBlock, RMSNorm, hc_post, rope_angles

__all__ = ["angles", "embed_streams", "head_losses", "layer_pieces", "lm_losses_from_hidden", "mtp_hidden",
           "mtp_pieces", "run_block", "run_layers"]


def angles(args: ModelArgs, s: int, device: torch.device | str) -> dict[bool, torch.Tensor]:
    """Rope angles of positions ``0..s-1`` for window-only (False) and compressed (True) layers."""
    if s > args.max_seq_len:
        raise ValueError(f"sequence length {s} exceeds max_seq_len={args.max_seq_len}")
    pos = torch.arange(s, device=device)
    return {False: rope_angles(args, pos, False), True: rope_angles(args, pos, True)}


def embed_streams(args: ModelArgs, embed: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """The first layer's input: each token's embedding copied into ``hc_mult`` streams ``[b, s, hc, dim]``."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an integer [batch, seq] tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    return embed(tokens).unsqueeze(2).repeat(1, 1, args.hc_mult, 1)


def run_block(block: Block, h: torch.Tensor, angles: dict[bool, torch.Tensor], tokens: torch.Tensor,
              wrap: LayerWrap | None = None) -> torch.Tensor:
    """``block.run(h, ...)`` as ``wrap`` runs the layer (whole-block recompute keeps only ``h`` for backward)."""
    return _wrapped(block, wrap, lambda x: block.run(x, angles, tokens))(h)


def _wrapped(block: Block, wrap: LayerWrap | None, fn: Callable) -> Callable:
    return fn if wrap is None else wrap(block, fn)


def run_layers(args: ModelArgs, layers: Sequence[Block], h: torch.Tensor, tokens: torch.Tensor,
               wrap: LayerWrap | None = None) -> torch.Tensor:
    """The layer loop on streams ``h [b, s, hc, dim]`` at positions ``0..s-1`` (a pipeline stage's slice);
    ``wrap``: how each layer runs (whole-block recompute, from outside)."""
    rope = angles(args, h.shape[1], h.device)
    for layer in layers:
        h = run_block(layer, h, rope, tokens, wrap)
    return h


def layer_pieces(block: Block, rope: dict[bool, torch.Tensor], stream: str = "h", tokens: str = "tokens",
                 token_ids: torch.Tensor | None = None, wrap: LayerWrap | None = None) -> list[Piece]:
    """One layer as pieces from and to the streams named ``stream``; the token ids are the value ``tokens``, or
    ``token_ids`` when given (an MTP depth's shifted tokens). ``wrap`` wraps each compute piece (recompute)."""
    reads = (stream,) if token_ids is not None else (stream, tokens)

    def ids(args: tuple) -> torch.Tensor:
        return token_ids if token_ids is not None else args[-1]

    def recomputed(fn: Callable[..., dict]) -> Callable[..., dict]:
        return _wrapped(block, wrap, fn)

    if not block.expert_parallel:
        return [Compute(f"layer {block.layer_id}", recomputed(lambda x, *t: {stream: block.run(x, rope, ids(t))}),
                        reads, (stream,))]
    moe = block.ffn

    def attention(x: torch.Tensor, *t: torch.Tensor) -> dict[str, Any]:
        h = block.attention(x, rope)
        y, post, comb = block.ffn_pre(h)
        send, plan, shared = moe.send(y.flatten(0, -2), ids(t), y.shape[-2])
        return {stream: h, "send": send, "plan": plan, "shared": shared, "post": post, "comb": comb}

    def output(h: torch.Tensor, back: torch.Tensor, plan, shared: torch.Tensor | None, post: torch.Tensor,
               comb: torch.Tensor) -> dict[str, Any]:
        y = moe.combined(back, plan, shared).view(*h.shape[:2], -1)
        return {stream: hc_post(y, h, post, comb)}

    return [
        Compute("attention", recomputed(attention), reads, (stream, "send", "plan", "shared", "post", "comb")),
        Exchange("dispatch", lambda send, plan: moe.ep.post_dispatch(send, plan, moe.dim), ("send", "plan"),
                 lands="rows", info="received"),
        Compute("experts", recomputed(lambda rows, received: {"y": moe.expert_rows(rows, received)}),
                ("rows", "received"), ("y",)),
        Exchange("combine", moe.ep.post_combine, ("y", "received"), lands="back"),
        Compute("output", output, (stream, "back", "plan", "shared", "post", "comb"), (stream,)),
    ]


def _depths(args: ModelArgs, modules: Sequence[MTPBlock], tokens: torch.Tensor) -> Iterator[tuple]:
    """``(k, n, module, angles)`` per MTP depth k = 1..D with positions left (depth k runs on ``s - k``)."""
    for k, module in enumerate(modules, start=1):
        n = tokens.shape[1] - k
        if n <= 0:
            return
        yield k, n, module, angles(args, n, tokens.device)


def mtp_hidden(args: ModelArgs, modules: Sequence[MTPBlock], embed: nn.Module, h: torch.Tensor,
               tokens: torch.Tensor, wrap: LayerWrap | None = None) -> list[torch.Tensor]:
    """Each MTP depth's streams (before its ``hc_head``) from the main model's last streams ``h``."""
    out = []
    for k, n, module, rope in _depths(args, modules, tokens):
        nxt = tokens[:, k:]
        h = run_block(module, module.project(h[:, :n], embed(nxt)), rope, nxt, wrap)
        out.append(h)
    return out


def mtp_pieces(args: ModelArgs, modules: Sequence[MTPBlock], embed: nn.Module, tokens: torch.Tensor,
               stream: str = "h", wrap: LayerWrap | None = None) -> tuple[list[Piece], list[str]]:
    """``mtp_hidden`` as plan pieces reading the main streams ``stream``; also the depths' value names."""
    pieces, names, prev = [], [], stream
    for k, n, module, rope in _depths(args, modules, tokens):
        name, nxt = f"mtp{k}", tokens[:, k:]
        project = lambda h, module=module, n=n, nxt=nxt, name=name: {name: module.project(h[:, :n], embed(nxt))}  # noqa: E731
        pieces += [Compute(f"mtp {k} input", project, (prev,), (name,)),
                   *layer_pieces(module, rope, name, token_ids=nxt, wrap=wrap)]
        names.append(name)
        prev = name
    return pieces, names


def head_losses(args: ModelArgs, hc_head: HCHead, norm: RMSNorm, head: nn.Linear, mtp: Sequence[MTPBlock],
                h: torch.Tensor, hidden: Sequence[torch.Tensor], labels: torch.Tensor,
                ignore_index: int = -100) -> dict:
    """V3's ``head_losses`` for streams: the main loss of ``head(norm(hc_head(h)))`` and depth k's of
    ``head(mtp[k].norm(mtp[k].hc_head(h_k)))``, through the fused head (no logits kept), and the total
    ``main + mtp_loss_weight / D * sum(mtp)``."""
    n = labels.shape[1]
    main = head_loss(norm, head, hc_head(h[:, :n]), labels, ignore_index)
    losses = [head_loss(module.norm, head, module.hc_head(hk[:, : n - k]), labels[:, k:], ignore_index)
              for k, (module, hk) in enumerate(zip(mtp, hidden), start=1) if n > k]
    total = main + args.mtp_loss_weight / len(losses) * torch.stack(losses).sum() if losses else main
    return {"loss": total, "main": main, "mtp": losses}


def lm_losses_from_hidden(args: ModelArgs, hc_head: HCHead, norm: RMSNorm, head: nn.Linear,
                          mtp: Sequence[MTPBlock], embed: nn.Module, h: torch.Tensor, tokens: torch.Tensor,
                          labels: torch.Tensor, ignore_index: int = -100, wrap: LayerWrap | None = None) -> dict:
    """The next-token and MTP losses from the main model's last streams ``h`` (``head_losses`` of ``mtp_hidden``)."""
    hidden = mtp_hidden(args, mtp, embed, h, tokens, wrap)
    return head_losses(args, hc_head, norm, head, mtp, h, hidden, labels, ignore_index)
