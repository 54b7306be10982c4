"""Forward-only passes through this rank's pipeline stages: validation loss and greedy samples.

Stages run in global order; a stage's owner receives the hidden state from the previous stage's
owner over the ``pp`` group (point-to-point, shapes known to both sides) and sends its output on.
All data-parallel ranks run the same sequence at the same time, so the expert-parallel all-to-alls
inside MoE layers pair up. The training schedule is not involved: this works for every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from training.config import ParallelConfig
from training.data import TokenCorpus
from training.parallel import ParallelState
from training.stages import DeepSeekV3Stage


def stage_owner(par: ParallelConfig) -> list[int]:
    """Global stage -> pipeline rank that runs it here (``dualpipe``: the down chain's copy, stage s on rank s)."""
    lay = par.layout
    return [lay.part_rank(s) for s in range(lay.num_parts)]


@contextlib.contextmanager
def eval_mode(stages: list[DeepSeekV3Stage]) -> Iterator[None]:
    """Modules in eval mode (balancers stop counting loads) for the block, then back to train."""
    for st in stages:
        st.eval()
    try:
        yield
    finally:
        for st in stages:
            st.train()


@torch.no_grad()
def pipeline_hidden(stages: list[DeepSeekV3Stage], par: ParallelConfig, ps: ParallelState,
                    tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Last hidden state (before the final norm) for ``tokens [b, s]`` on the rank holding the last
    stage; None elsewhere. Every rank must call it with the same shapes."""
    owner = stage_owner(par)
    me = ps.coords.pp_rank
    local = {st.stage_id: st for st in stages}
    pp_ranks = ps.ranks["pp"]
    out: list[torch.Tensor] = []  # the last stage's output: what the next stage takes (DeepSeekV3Stage.input_specs)
    with eval_mode(stages):
        for s in range(len(owner)):
            if owner[s] != me:
                continue
            if s == 0:
                xs = [tokens]
            elif owner[s - 1] == me:
                xs = out
            else:
                xs = [torch.empty(shape, dtype=dt, device=tokens.device)
                      for shape, dt in local[s].input_specs(tokens, dtype)]
                for x in xs:
                    dist.recv(x, src=pp_ranks[owner[s - 1]], group=ps.group("pp"))
            y = local[s](*xs)
            out = [y] if isinstance(y, torch.Tensor) else list(y)
            nxt = s + 1
            if nxt < len(owner) and owner[nxt] != me:
                for t in out:
                    dist.send(t.contiguous(), dst=pp_ranks[owner[nxt]], group=ps.group("pp"))
    h = out[0] if out else None
    return h if owner[-1] == me else None


@torch.no_grad()
def pipeline_generate(stages: list[DeepSeekV3Stage], par: ParallelConfig, ps: ParallelState, tokenizer,
                      corpus: TokenCorpus, prompt: str, max_new_tokens: int, seq_len: int, dtype: torch.dtype,
                      device: torch.device, companions: int = 3, temperature: float = 0.0, seed: int = 0) -> str:
    """Continuation of ``prompt``: greedy, or sampled at ``temperature`` from a generator seeded by
    ``seed`` on the rank holding the head (the token is then broadcast). The context is cut to
    ``seq_len`` tokens. ``tokenizer`` has ``encode``/``decode``.

    The prompt is decoded in a batch with ``companions`` held-out text prefixes of the same length,
    so a short prompt still spreads tokens over the expert-parallel ranks (a rank that receives
    none is handled, but wastes its turn in the all-to-all).
    """
    ids = tokenizer.encode(prompt) or [0]
    rows = [ids]
    for c in range(companions if corpus.num_valid else 0):
        window = corpus.window(corpus.num_train + c % corpus.num_valid)
        rows.append(window[: len(ids)].tolist())
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    holder = stage_owner(par)[-1]
    gen = torch.Generator(device=device).manual_seed(seed)
    cp = stages[0].cp
    for _ in range(max_new_tokens):
        ctx = tokens[:, -seq_len:]
        if cp is None:
            h = pipeline_hidden(stages, par, ps, ctx, dtype)
            last = h[:, -1] if h is not None else None
        else:
            h, last, held = _context_parallel_last(stages, par, ps, ctx, dtype)
        nxt = torch.zeros(len(rows), dtype=torch.long, device=device)
        if h is not None:
            st = next(s for s in stages if s.is_last)
            with eval_mode(stages):
                logits = st.logits(last[:, None])[:, 0].float()
                if cp is not None:  # the last position's logits, from the CP rank holding it, on every CP rank
                    logits = logits if held else torch.zeros_like(logits)
                    dist.all_reduce(logits, group=ps.group("cp"))
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt.copy_(torch.multinomial(probs, 1, generator=gen).squeeze(1))
                else:
                    nxt.copy_(logits.argmax(-1))
        if ps.size("pp") > 1:
            dist.broadcast(nxt, src=ps.ranks["pp"][holder], group=ps.group("pp"))
        tokens = torch.cat([tokens, nxt.view(-1, 1)], dim=1)
    return tokenizer.decode(tokens[0, len(ids):].tolist())


def _context_parallel_last(stages: list[DeepSeekV3Stage], par: ParallelConfig, ps: ParallelState,
                           ctx: torch.Tensor, dtype: torch.dtype
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """Under context parallelism: ``ctx [b, n <= seq_len]`` padded on the right to the run's ``seq_len`` (the
    padding comes after every real position: causally invisible to them), split over the CP group and run
    through the pipeline. Returns (this rank's last hidden state or None off the last stage, the row of
    position ``n - 1`` (any row where another CP rank holds it), whether this rank holds it)."""
    cp = stages[0].cp
    padded = torch.nn.functional.pad(ctx, (0, cp.seq_len - ctx.shape[1]))
    h = pipeline_hidden(stages, par, ps, cp.split(padded), dtype)
    if h is None:
        return None, None, False
    held = (cp.positions(h.device) == ctx.shape[1] - 1).nonzero()
    return h, h[:, int(held[0, 0]) if held.numel() else 0], bool(held.numel())
