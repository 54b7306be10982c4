"""Context extension at CPU size: train short, extend with YaRN, and show what the extension buys.

    python -m recipes.long_context [--out runs/long_context] [--short-len 128] [--extend-factor 4] [--cp 2]
                                   [--short-steps 400] [--extend-steps 100] [--key-digits 1] [--set k=v ...]

Both stages run through the real CLI (``python -m recipes.train``), each on a synthetic passkey corpus this
recipe writes into ``--out``: documents of exactly one training window, each a stretch of the bundled corpus
with ``the passkey is K.`` stated at a random depth and asked for again at the end (``So the passkey is K.``),
K being ``--key-digits`` random digits (the filler has none), so that retrieving it over the whole window is
learnable and measurable.

1. ``short``: ``recipes/configs/long_context_short_cpu.toml``, the demo's ``debug`` model with plain RoPE at
   ``--short-len`` tokens; exported with ``recipes.export_hf``.
2. ``extend``: ``recipes/configs/long_context_extend_cpu.toml`` from that export (``model.init_from``), at
   ``--extend-factor`` x the length with V3's YaRN (``rope_factor`` = the factor, ``original_seq_len`` = the
   short length, beta_fast 32, beta_slow 1, mscale 1.0), on ``--cp`` context-parallel ranks.

Then both checkpoints, and the short one with the extended RoPE but no further training (``short+yarn``), are
evaluated on held-out documents (filler from the corpus's last tenth, fresh passkeys) at the long length:
the next-token loss per position (averaged in buckets; ``long_context.png``) and passkey retrieval at depths
0, 25, 50, 75 and 100 % of the document (exact match of the key, each digit the argmax given the ones before
it -- the same as greedy generation; chance is 10 ** -digits), and retrieval at the short length for
reference. A table is printed; everything goes to ``long_context.json``.

Exit status: 0 done, 2 bad input (one ``error:`` line; nothing written), 1 a stage failed (its output's tail
is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from accel.cli import BAD_INPUT, OK, ArgumentParser, check_output_dir, positive_int
from models.deepseek_v3 import ModelArgs, Transformer, load_hf_checkpoint
from recipes.benchutil import TrainingRefused, export_hf, load_option, print_report, run_training
from training.config import TrainConfig
from training.data import BUNDLED_CORPUS
from training.trainer import check_static

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "recipes" / "configs"
QUIET = ["logging.progress=false", "logging.wandb=disabled", "run.sample_tokens=0"]
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
KEY_DIGITS = 1  # default --key-digits
EVAL_SPLIT = 0.9  # training documents take their filler from the corpus's first 90 %, evaluation from the rest


def needle(key: str) -> str:
    return f" the passkey is {key}. "


def query(key: str) -> str:
    return f" So the passkey is {key}.\n"


def filler_text(path: Path = BUNDLED_CORPUS) -> str:
    """The bundled corpus as ASCII (one byte = one token of the byte tokenizer) without digits, so that a
    document's passkey is its only number, whitespace runs collapsed."""
    text = path.read_text(encoding="utf-8").encode("ascii", "ignore").decode("ascii")
    return " ".join(text.translate(str.maketrans("", "", "0123456789")).split())


def passkey_document(rng: random.Random, text: str, length: int, depth: float, digits: int = KEY_DIGITS
                     ) -> tuple[str, str, int]:
    """A document of exactly ``length`` ASCII characters: a random stretch of ``text`` with the needle (a key of
    ``digits`` random digits) inserted at ``depth`` (0 = first, 1 = just before the question) and the question at
    the end. Returns (document, key, offset of the key's first digit in the question)."""
    key = "".join(rng.choice("0123456789") for _ in range(digits))
    room = length - len(needle(key)) - len(query(key))
    start = rng.randrange(len(text) - room)
    stretch = text[start:start + room]
    cut = round(depth * room)
    doc = stretch[:cut] + needle(key) + stretch[cut:] + query(key)
    return doc, key, length - len(query(key)) + query(key).index(key)


def write_corpus(path: Path, text: str, length: int, n_docs: int, seed: int, digits: int = KEY_DIGITS) -> None:
    """``n_docs`` passkey documents of ``length`` bytes at uniformly random depths, back to back: the trainer cuts
    windows of ``length`` + 1 tokens at a stride of ``length``, so each window is one document (its last label
    is the next document's first byte)."""
    rng = random.Random(seed)
    docs = [passkey_document(rng, text, length, rng.random(), digits)[0] for _ in range(n_docs)]
    path.write_text("".join(docs) + "\n", encoding="ascii")


def eval_set(text: str, length: int, per_depth: int, seed: int, digits: int = KEY_DIGITS
             ) -> list[tuple[float, str, int]]:
    """``per_depth`` held-out documents at each of ``DEPTHS``: (depth, document, offset of the answer)."""
    rng = random.Random(seed)
    out = []
    for depth in DEPTHS:
        for _ in range(per_depth):
            doc, _, answer = passkey_document(rng, text, length, depth, digits)
            out.append((depth, doc, answer))
    return out


@torch.no_grad()
def evaluate(model: Transformer, docs: list[tuple[float, str, int]], digits: int = KEY_DIGITS, batch: int = 16
             ) -> tuple[torch.Tensor, dict[float, float], dict[float, float]]:
    """Main-head next-token loss per position (float64 ``[length - 1]``, mean over ``docs``); per depth, the
    passkey exact-match rate (every key digit the argmax of its position's logits: greedy generation's answer)
    and the mean loss on the key digits in the question (ln 10 = 2.30 is a guess, 0 a sure retrieval)."""
    model.eval()
    loss_sum, hits, key_loss = None, {d: [] for d in DEPTHS}, {d: [] for d in DEPTHS}
    for i in range(0, len(docs), batch):
        part = docs[i:i + batch]
        tokens = torch.tensor([list(doc.encode("ascii")) for _, doc, _ in part], dtype=torch.long)
        logits = model(tokens[:, :-1]).double()
        loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss_sum = loss.sum(0) if loss_sum is None else loss_sum + loss.sum(0)
        pred = logits.argmax(-1)
        for row, (depth, _, answer) in enumerate(part):
            span = slice(answer - 1, answer - 1 + digits)  # logits at p predict token p + 1
            hits[depth].append(bool((pred[row, span] == tokens[row, answer:answer + digits]).all()))
            key_loss[depth].append(loss[row, span].mean().item())
    return (loss_sum / len(docs), {d: sum(h) / len(h) for d, h in hits.items()},
            {d: sum(v) / len(v) for d, v in key_loss.items()})


def load_model(folder: Path, **changes) -> Transformer:
    """The HF export in ``folder`` as an fp32 CPU model, with ``changes`` to its ``ModelArgs`` (RoPE settings)."""
    args = dataclasses.replace(ModelArgs.from_hf_config(folder), **changes)
    return load_hf_checkpoint(args, folder)


def docs_needed(cfg: TrainConfig) -> int:
    """Documents for ``cfg``'s run: one window per sequence of every step, plus the held-out tail, plus one
    global batch of slack."""
    used = cfg.run.steps * cfg.data.global_batch
    return math.ceil(used / (1 - cfg.data.valid_fraction)) + cfg.data.global_batch


def stage_config(option: str, path: str, sets: list[str]) -> TrainConfig:
    """``load_config`` plus the launch's static checks (layout, world size), the corpus not yet written; errors
    name ``option``."""
    if not Path(path).is_file():
        raise ValueError(f"{option} {path!r}: no such file; expected a TOML config")
    cfg = load_option(option, path, sets)
    check_static(cfg, cfg.run.nproc, allow_missing_data=True)
    return cfg


def plot(path: Path, curves: dict[str, list[float]], edges: list[int], short_len: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    for name, values in curves.items():
        ax.plot(mids, values, marker="o", ms=3, label=name)
    ax.axvline(short_len, color="grey", ls="--", lw=1, label=f"short training length ({short_len})")
    ax.set_xlabel("position in the sequence")
    ax.set_ylabel("next-token loss (nats), bucket mean")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def extend_factor(text: str) -> float:
    """argparse type of ``--extend-factor``: a finite number > 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 1:
        raise argparse.ArgumentTypeError(f"expected a finite number > 1 (the long length over the short one, and "
                                         f"the YaRN factor), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.long_context", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/long_context", help="folder (new or empty) for corpora, runs, exports, "
                                                               "plot and JSON")
    ap.add_argument("--short-len", type=positive_int, default=128, help="stage 1's sequence length")
    ap.add_argument("--extend-factor", type=extend_factor, default=4.0,
                    help="stage 2's length over stage 1's, and the YaRN factor")
    ap.add_argument("--cp", type=positive_int, default=2, help="context-parallel ranks of stage 2")
    ap.add_argument("--short-steps", type=positive_int, default=None,
                    help="stage 1's steps (default: the short config's run.steps)")
    ap.add_argument("--extend-steps", type=positive_int, default=None,
                    help="stage 2's steps (default: the extend config's run.steps)")
    ap.add_argument("--key-digits", type=positive_int, default=KEY_DIGITS,
                    help="digits of the passkey (chance of an exact match: 10 ** -digits)")
    ap.add_argument("--eval-docs", type=positive_int, default=24, help="held-out documents per passkey depth")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the corpora, the held-out set and both runs")
    ap.add_argument("--short-config", default=str(CONFIGS / "long_context_short_cpu.toml"), help="stage 1's config")
    ap.add_argument("--extend-config", default=str(CONFIGS / "long_context_extend_cpu.toml"), help="stage 2's config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key of both stages (repeatable)")
    ns = ap.parse_args(argv)
    out = Path(ns.out).absolute()
    text = filler_text()
    factor = ns.extend_factor
    short_len = ns.short_len
    long_len = round(short_len * factor)
    base = QUIET + [f"run.seed={ns.seed}"] + ns.overrides
    short_sets = base + [f"data.seq_len={short_len}", f"data.source={out / 'short_corpus.txt'}",
                         f"model.overrides.max_seq_len={long_len}"]
    if ns.short_steps:
        short_sets.append(f"run.steps={ns.short_steps}")
    extend_sets = base + [f"data.seq_len={long_len}", f"data.source={out / 'extend_corpus.txt'}",
                          f"model.overrides.max_seq_len={long_len}", f"model.overrides.rope_factor={factor}",
                          f"model.overrides.original_seq_len={short_len}", f"model.init_from={out / 'short_hf'}",
                          f"parallel.cp={ns.cp}", f"run.nproc={ns.cp}"]
    if ns.extend_steps:
        extend_sets.append(f"run.steps={ns.extend_steps}")
    try:
        if short_len * factor != long_len:
            raise ValueError(f"--extend-factor {ns.extend_factor}: --short-len {short_len} x it must be a whole "
                             f"number of tokens, got {short_len * factor}")
        shortest = 2 * len(query("0" * ns.key_digits)) + len(needle("0" * ns.key_digits))
        if short_len < shortest:
            raise ValueError(f"--short-len {short_len}: a passkey document with a {ns.key_digits}-digit key needs at "
                             f"least {shortest} tokens")
        check_output_dir(str(out), "--out", must_be_empty=True)
        short_cfg = stage_config("--short-config", ns.short_config, short_sets)
        extend_cfg = stage_config("--extend-config", ns.extend_config, extend_sets)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT

    out.mkdir(parents=True, exist_ok=True)
    split = int(len(text) * EVAL_SPLIT)
    train_text, eval_text = text[:split], text[split:]
    write_corpus(out / "short_corpus.txt", train_text, short_len, docs_needed(short_cfg), ns.seed, ns.key_digits)
    write_corpus(out / "extend_corpus.txt", train_text, long_len, docs_needed(extend_cfg), ns.seed + 1, ns.key_digits)
    try:
        print(f"== short: {short_cfg.run.steps} steps at {short_len} tokens, plain RoPE", flush=True)
        short_log = run_training(ns.short_config, short_cfg.run.nproc, short_sets, out / "short")
        export_hf(out / "short", out / "short_hf")
        print(f"== extend: {extend_cfg.run.steps} steps at {long_len} tokens, YaRN x{factor:g}, cp {ns.cp}",
              flush=True)
        extend_log = run_training(ns.extend_config, extend_cfg.run.nproc, extend_sets, out / "extend")
    except TrainingRefused as exc:
        print(f"error: {' '.join(exc.line.split())}", file=sys.stderr)
        return BAD_INPUT
    export_hf(out / "extend", out / "extend_hf")

    extended = ModelArgs.from_hf_config(out / "extend_hf")  # the RoPE the extension trained with
    yarn = {f: getattr(extended, f) for f in ("rope_factor", "original_seq_len", "max_seq_len", "beta_fast",
                                              "beta_slow", "mscale", "mscale_all_dim")}
    models = {"short": load_model(out / "short_hf", max_seq_len=long_len),
              "short+yarn": load_model(out / "short_hf", **yarn),
              "extended": load_model(out / "extend_hf")}
    long_docs = eval_set(eval_text, long_len, ns.eval_docs, ns.seed + 2, ns.key_digits)
    short_docs = eval_set(eval_text, short_len, ns.eval_docs, ns.seed + 3, ns.key_digits)
    width = max(1, long_len // 16)
    edges = list(range(0, long_len - 1, width)) + [long_len - 1]
    result: dict = {"short_len": short_len, "long_len": long_len, "extend_factor": factor, "cp": ns.cp,
                    "seed": ns.seed, "key_digits": ns.key_digits, "depths": list(DEPTHS),
                    "eval_docs_per_depth": ns.eval_docs,
                    "stages": {}, "bucket_edges": edges, "position_loss": {}, "loss_within_short": {},
                    "loss_beyond_short": {}, "passkey_long": {}, "passkey_short": {},
                    "key_loss_long": {}, "key_loss_short": {}}
    for name, log, cfg in (("short", short_log, short_cfg), ("extend", extend_log, extend_cfg)):
        losses = [m["loss"] for m in log if "loss" in m]
        result["stages"][name] = {"steps": cfg.run.steps, "seq_len": cfg.data.seq_len,
                                  "first_loss": losses[0], "last_loss": losses[-1],
                                  "valid_loss": json.loads((out / name / "summary.json").read_text())["valid_loss"]}
    for name, model in models.items():
        per_pos, acc_long, key_long = evaluate(model, long_docs, ns.key_digits)
        _, acc_short, key_short = evaluate(model, short_docs, ns.key_digits)
        result["position_loss"][name] = [per_pos[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])]
        result["loss_within_short"][name] = per_pos[:short_len - 1].mean().item()
        result["loss_beyond_short"][name] = per_pos[short_len - 1:].mean().item()
        result["passkey_long"][name] = [acc_long[d] for d in DEPTHS]
        result["passkey_short"][name] = [acc_short[d] for d in DEPTHS]
        result["key_loss_long"][name] = [key_long[d] for d in DEPTHS]
        result["key_loss_short"][name] = [key_short[d] for d in DEPTHS]
    (out / "long_context.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(out / "long_context.png", result["position_loss"], edges, short_len,
         f"held-out passkey documents of {long_len} tokens: before and after YaRN x{factor:g}")

    rows = []
    for name in models:
        row = {"model": name, f"loss <{short_len}": result["loss_within_short"][name],
               f"loss >={short_len}": result["loss_beyond_short"][name]}
        row.update({f"key@{int(d * 100)}%": a for d, a in zip(DEPTHS, result["passkey_long"][name])})
        row[f"key@{short_len} (mean)"] = sum(result["passkey_short"][name]) / len(DEPTHS)
        row[f"digit loss @{long_len}"] = sum(result["key_loss_long"][name]) / len(DEPTHS)
        row[f"@{short_len}"] = sum(result["key_loss_short"][name]) / len(DEPTHS)
        rows.append(row)
    print_report(f"Context extension {short_len} -> {long_len} tokens (YaRN x{factor:g}), held-out documents", rows,
                 notes=[f"loss: main-head next-token loss at positions below / from {short_len}, mean over "
                        f"{len(long_docs)} documents of {long_len} tokens",
                        f"key@D: passkey exact match at depth D of a {long_len}-token document "
                        f"({ns.eval_docs} documents each); key@{short_len}: the same at the short length, all depths",
                        "digit loss: mean loss on the key's digits in the question, all depths (ln 10 = 2.30 is a "
                        "guess, 0 a sure retrieval)",
                        "short+yarn: the short model with the extended RoPE, no training at the long length",
                        f"plot: {out / 'long_context.png'}; numbers: {out / 'long_context.json'}"])
    return OK


if __name__ == "__main__":
    sys.exit(main())
