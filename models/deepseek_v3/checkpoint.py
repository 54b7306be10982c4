"""HF-format checkpoint IO for DeepSeek-V3: sharded safetensors + ``model.safetensors.index.json`` + ``config.json``.

Key names are the released checkpoints' (``model.layers.{i}.self_attn.q_a_proj.weight``, per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``, the MTP module at layer ``num_hidden_layers + k``,
...). Our modules fuse what HF keeps apart (gate|up projections, all experts of a layer into one
``[E, ...]`` tensor); ``hf_plan`` says which HF keys make up each of our tensors, and both load and
save go through it.

Loading streams: it opens one shard at a time and reads only the tensors whose destination is
materialised on this process (parameters left on the ``meta`` device -- other pipeline stages --
and experts outside this rank's ``expert_ids`` are never read), copying each straight into its
slice of the destination. FP8 weights (e4m3 with a ``weight_scale_inv`` per 128x128 block) are
dequantised on load (so are exports written before ``eh_proj`` was kept in BF16). A file that cannot be
read -- a truncated or garbled shard, index or ``config.json`` -- raises a ValueError naming the file.
Anything inconsistent -- an unknown key, a missing key, a shape or dtype
mismatch -- raises a ValueError naming the key and the expected shape; nothing is half loaded
silently.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import deep_gemm
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.indexer import Indexer
from models.deepseek_v3.model import Transformer

INDEX_NAME = "model.safetensors.index.json"
FP8_BLOCK = 128
SAVE_DTYPES = (torch.bfloat16, torch.float32)  # what ``save_hf_checkpoint(dtype=...)`` can write weights in

_ATTN_KEYS = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_MTP_KEYS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}


@dataclass
class Piece:
    """HF tensor ``key`` holds rows ``[row, row + rows)`` of our tensor (of expert ``expert`` when stacked)."""

    key: str
    expert: int | None
    row: int
    rows: int
    quantizable: bool  # stored as e4m3 + weight_scale_inv in the released checkpoints


def _block_pieces(prefix: str, ours: str, tensor_rows: int) -> list[tuple[str, int, int]] | None:
    """HF keys ``(key, row, rows)`` for our Block-relative name ``ours`` (``attn.wq_a.weight`` ...)."""
    parts = ours.split(".")
    if parts[0] in ("attn_norm", "ffn_norm"):
        name = "input_layernorm" if parts[0] == "attn_norm" else "post_attention_layernorm"
        return [(f"{prefix}.{name}.weight", 0, tensor_rows)]
    if parts[0] == "attn" and parts[1] in _ATTN_KEYS:
        return [(f"{prefix}.self_attn.{_ATTN_KEYS[parts[1]]}.weight", 0, tensor_rows)]
    if parts[0] == "attn" and parts[1] == "indexer":  # V3.2's lightning indexer: the same names in HF and the release
        return [(f"{prefix}.self_attn.indexer.{'.'.join(parts[2:])}", 0, tensor_rows)]
    if parts[0] != "ffn":
        return None
    rest = parts[1:]
    if rest[0] == "gate":
        return [(f"{prefix}.mlp.gate.{rest[1]}", 0, tensor_rows)]
    mlp = f"{prefix}.mlp" if rest[0] in ("w13", "w2") else f"{prefix}.mlp.shared_experts"
    which = rest[0] if rest[0] in ("w13", "w2") else rest[1]
    if which == "w13":
        half = tensor_rows // 2
        return [(f"{mlp}.gate_proj.weight", 0, half), (f"{mlp}.up_proj.weight", half, half)]
    return [(f"{mlp}.down_proj.weight", 0, tensor_rows)]


def hf_plan(model: Transformer) -> dict[str, list[Piece]]:
    """For each of the model's parameters/persistent buffers (by our name): the HF pieces it is made of."""
    n_layers = model.args.n_layers
    plan: dict[str, list[Piece]] = {}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers())
    for name, t in tensors.items():
        if name == "embed.weight":
            plan[name] = [Piece("model.embed_tokens.weight", None, 0, t.shape[0], False)]
        elif name == "norm.weight":
            plan[name] = [Piece("model.norm.weight", None, 0, t.shape[0], False)]
        elif name == "head.weight":
            if model.args.tie_word_embeddings:
                continue
            plan[name] = [Piece("lm_head.weight", None, 0, t.shape[0], False)]
        elif name.startswith(("layers.", "mtp.")):
            kind, idx, rest = name.split(".", 2)
            layer = int(idx) if kind == "layers" else n_layers + int(idx)
            prefix = f"model.layers.{layer}"
            if kind == "mtp" and not rest.startswith("block."):
                # enorm, hnorm, shared_head.norm and eh_proj: the release keeps all four in BF16, unquantised
                module = rest.split(".")[0]
                plan[name] = [Piece(f"{prefix}.{_MTP_KEYS[module]}.weight", None, 0, t.shape[0], False)]
                continue
            if kind == "mtp":
                rest = rest[len("block."):]
            if rest.startswith("ffn.experts."):
                experts = _experts_of(model, kind, int(idx))
                which = rest.split(".")[2]  # w13 | w2
                rows = t.shape[1]
                plan[name] = [
                    Piece(f"{prefix}.mlp.experts.{e}.{proj}.weight", i, row, n, True)
                    for i, e in enumerate(experts)
                    for proj, row, n in ((("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows // 2))
                                         if which == "w13" else (("down_proj", 0, rows),))
                ]
                continue
            pieces = _block_pieces(prefix, rest, t.shape[0])
            if pieces is None:
                raise ValueError(f"hf_plan: no HF name for model tensor {name!r}")
            # the release keeps the indexer's weights_proj unquantised (transformers keeps it in fp32)
            quant = not ("norm" in rest or ".gate." in rest or "weights_proj" in rest)
            plan[name] = [Piece(k, None, row, n, quant) for k, row, n in pieces]
        else:
            raise ValueError(f"hf_plan: no HF name for model tensor {name!r}")
    return plan


def _experts_of(model: Transformer, kind: str, idx: int) -> range:
    block = model.layers[idx] if kind == "layers" else model.mtp[idx].block
    return block.ffn.experts.expert_ids


def _redundant_keys(args: ModelArgs) -> set[str]:
    """HF keys of the released format that hold copies of shared tensors (MTP's embedding and head)."""
    keys = set()
    for k in range(args.n_mtp_layers):
        prefix = f"model.layers.{args.n_layers + k}"
        keys |= {f"{prefix}.embed_tokens.weight", f"{prefix}.shared_head.head.weight"}
    return keys


def _expected_keys(args: ModelArgs) -> set[str]:
    """Every key a full checkpoint of ``args`` holds (scale_inv keys excluded)."""
    with torch.device("meta"):
        full = Transformer(args)
    return {p.key for pieces in hf_plan(full).values() for p in pieces} | _redundant_keys(args)


# ---------------------------------------------------------------------------------------------------- load
def read_index(path: Path) -> dict[str, str]:
    """The folder's tensor name -> shard file map (its safetensors index, or a single ``model.safetensors``'s keys);
    a ValueError naming the file for anything unreadable (V3's and V4's loaders)."""
    if not path.is_dir():
        raise ValueError(f"load_hf_checkpoint: {path} is not a folder; expected an HF checkpoint folder")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"load_hf_checkpoint: {index} is not a readable safetensors index "
                             f"({_one_line(exc)}); expected JSON with a 'weight_map' object") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"load_hf_checkpoint: {index}: 'weight_map' must map tensor names to file names")
        return weight_map
    single = path / "model.safetensors"
    if single.is_file():
        with open_shard(single) as f:
            return {k: single.name for k in f.keys()}
    raise ValueError(f"load_hf_checkpoint: {path} has neither {INDEX_NAME} nor model.safetensors")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def open_shard(file: Path) -> Iterator:
    """``safe_open(file)``; a missing, truncated or garbled file is a ValueError naming it."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"load_hf_checkpoint: cannot read {file}: {_one_line(exc)}") from None
    with handle as f:
        yield f


SCALE_FORMATS = (None, "ue8m0")  # quantization_config.scale_fmt: fp32 scales (V3), or powers of two (V3.1+)


def checkpoint_scale_fmt(path: Path) -> str | None:
    """``quantization_config.scale_fmt`` of the checkpoint's config.json (None: absent, or no config.json)."""
    file = path / "config.json"
    if not file.is_file():
        return None
    fmt = (json.loads(file.read_text()).get("quantization_config") or {}).get("scale_fmt")
    if fmt not in SCALE_FORMATS:
        raise ValueError(f"{file}: quantization_config.scale_fmt must be 'ue8m0' or absent, got {fmt!r}")
    return fmt


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, key: str = "",
                          scale_fmt: str | None = None) -> torch.Tensor:
    """e4m3 ``weight [N, K]`` times its per-128x128-block ``scale_inv [ceil(N/128), ceil(K/128)]``, in fp32.

    ``scale_fmt="ue8m0"`` (DeepSeek-V3.1+): every scale must be a power of two (stored as fp32 or as
    ``float8_e8m0fnu``), so each product is exact in fp32."""
    n, k = weight.shape
    want = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{key}_scale_inv: expected shape {want} for a {tuple(weight.shape)} FP8 weight, "
                         f"got {tuple(scale_inv.shape)}")
    if scale_fmt == "ue8m0" and not deep_gemm.utils.is_ue8m0(scale_inv.float()):
        raise ValueError(f"{key}_scale_inv: scale_fmt is 'ue8m0' but the scales are not all powers of two")
    full = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.float() * full


def load_hf_checkpoint(model_or_args: Transformer | ModelArgs | None, path: str | Path, *,
                       device: torch.device | str = "cpu", expert_ids: range | None = None,
                       dtype: torch.dtype | None = None, strict: bool = True, fresh_indexer: bool = False
                       ) -> Transformer:
    """Load an HF-format DeepSeek-V3 checkpoint directory into a model and return the model.

    ``model_or_args``: a ``Transformer`` (its non-meta tensors are filled; meta ones -- another
    stage's -- are skipped), a ``ModelArgs`` or None (read ``config.json``), in which case the model
    is built on ``device`` with ``expert_ids`` (default: all) in ``dtype`` (default: fp32).
    ``strict``: unknown checkpoint keys are an error (keys this process does not need are always
    skipped without being read). ``fresh_indexer``: the checkpoint is a DeepSeek-V3 one, without V3.2's
    lightning indexer: the model's indexers keep their initialisation (a model built here is initialised
    as ``Transformer.init_weights``), to start V3.2's dense warm-up from V3 weights.
    """
    path = Path(path)
    if isinstance(model_or_args, Transformer):
        model = model_or_args
    else:
        args = model_or_args if isinstance(model_or_args, ModelArgs) else ModelArgs.from_hf_config(path)
        with torch.device("meta"):
            model = Transformer(args, expert_ids=expert_ids)
        model.to_empty(device=device)
        if dtype is not None:
            model.to(dtype)
        for module in model.modules():  # the router bias stays fp32 whatever the model dtype
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                module.e_score_correction_bias = bias.float()
        if fresh_indexer:
            for module in model.modules():
                if isinstance(module, Indexer):
                    model.init_weights(module)
    args = model.args
    if fresh_indexer and not args.index_topk:
        raise ValueError("load_hf_checkpoint: fresh_indexer=True needs a model with an indexer (index_topk > 0)")
    weight_map = read_index(path)
    if strict:
        expected = _expected_keys(args)
        unknown = sorted(k for k in weight_map if k not in expected
                         and not (k.endswith("_scale_inv") and k[: -len("_scale_inv")] in expected))
        if unknown:
            raise ValueError(f"load_hf_checkpoint: {len(unknown)} unexpected key(s) in {path} for this config, "
                             f"e.g. {unknown[:5]}")
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    # destination of every HF key this process needs
    wanted: dict[str, tuple[str, torch.Tensor, Piece]] = {}
    for name, pieces in hf_plan(model).items():
        t = tensors[name]
        if t.is_meta:
            continue
        for p in pieces:
            dst = t[p.expert] if p.expert is not None else t
            if fresh_indexer and ".self_attn.indexer." in p.key:
                if p.key in weight_map:
                    raise ValueError(f"load_hf_checkpoint: fresh_indexer=True but {path} holds {p.key}: it is a "
                                     "V3.2 checkpoint; load it without fresh_indexer")
                continue
            wanted[p.key] = (name, dst.narrow(0, p.row, p.rows), p)
    missing = [k for k in wanted if k not in weight_map]
    if missing:
        shapes = [f"{k} (expected shape {tuple(wanted[k][1].shape)})" for k in sorted(missing)[:5]]
        raise ValueError(f"load_hf_checkpoint: {len(missing)} key(s) missing from {path}: {', '.join(shapes)}")
    scale_fmt = checkpoint_scale_fmt(path)
    by_file: dict[str, list[str]] = defaultdict(list)
    for k in wanted:
        by_file[weight_map[k]].append(k)
    with torch.no_grad():
        for file, keys in sorted(by_file.items()):
            with open_shard(path / file) as f:
                for key in keys:
                    _, dst, _ = wanted[key]
                    src = f.get_tensor(key)
                    if src.dtype == torch.float8_e4m3fn:
                        scale_key = f"{key}_scale_inv"
                        if scale_key not in weight_map:
                            raise ValueError(f"load_hf_checkpoint: {key} is FP8 but {scale_key} is missing")
                        with open_shard(path / weight_map[scale_key]) as g:
                            src = dequantize_fp8_blocks(src, g.get_tensor(scale_key), key, scale_fmt)
                    if not src.dtype.is_floating_point:
                        raise ValueError(f"load_hf_checkpoint: {key} has dtype {src.dtype}; expected a floating "
                                         f"dtype (shape {tuple(dst.shape)})")
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(f"load_hf_checkpoint: {key} has shape {tuple(src.shape)}; expected "
                                         f"{tuple(dst.shape)}")
                    dst.copy_(src)
    return model


# ---------------------------------------------------------------------------------------------------- save
def save_hf_checkpoint(model: Transformer, path: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                       dtype: torch.dtype | None = None, fp8: bool = False, scale_fmt: str | None = None) -> None:
    """Write ``model`` as an HF DeepSeek-V3 checkpoint (config.json, shards, index) into directory ``path``.

    Tensors keep their dtype (so save -> load -> save is bit-exact) unless ``dtype`` (one of
    ``SAVE_DTYPES``) is given. ``fp8`` writes the released V3 layout: the GEMM weights of the blocks
    (attention projections, dense, shared and routed experts) as e4m3 + a ``weight_scale_inv`` per
    128x128 block, everything else -- embedding, head, norms, router, MTP's ``eh_proj`` -- unquantised in
    ``dtype`` (default bfloat16, as released); the router's ``e_score_correction_bias`` stays fp32.
    ``scale_fmt="ue8m0"`` (with ``fp8``) rounds each block's scale up to a power of two, as DeepSeek-V3.1+
    checkpoints declare in ``quantization_config``.
    The safetensors shards get the permissions the JSON files beside them get (this process's umask).
    The model must be whole (no meta tensors, all experts); a sharded model is saved by ``training.checkpoint``.
    """
    if dtype is not None and dtype not in SAVE_DTYPES:
        raise ValueError(f"save_hf_checkpoint: dtype {dtype} cannot hold the weights; expected one of "
                         f"{[str(d).removeprefix('torch.') for d in SAVE_DTYPES]} (FP8: fp8=True)")
    if scale_fmt not in SCALE_FORMATS or (scale_fmt and not fp8):
        raise ValueError(f"save_hf_checkpoint: scale_fmt must be None or 'ue8m0' (with fp8=True), got {scale_fmt!r}")
    if fp8 and dtype is None:
        dtype = torch.bfloat16
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for name, pieces in hf_plan(model).items():
        t = tensors[name].detach()
        if t.is_meta:
            raise ValueError(f"save_hf_checkpoint: {name} is on the meta device; save needs the whole model")
        for p in pieces:
            value = (t[p.expert] if p.expert is not None else t).narrow(0, p.row, p.rows)
            if fp8 and p.quantizable and value.dim() == 2:  # quantised from the weights as trained, not a cast
                # amax / 448 per 128x128 block (rounded up to a power of two for ue8m0)
                value, scale = deep_gemm.per_block_cast_to_fp8(value.float(), use_ue8m0=scale_fmt == "ue8m0")
                out[f"{p.key}_scale_inv"] = scale
            elif dtype is not None and value.is_floating_point() and not p.key.endswith("e_score_correction_bias"):
                value = value.to(dtype)
            out[p.key] = value.contiguous().cpu().clone()
    for k in range(model.args.n_mtp_layers):
        prefix = f"model.layers.{model.args.n_layers + k}"
        out[f"{prefix}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[f"{prefix}.shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
    cfg = model.args.to_hf_config()
    cfg["torch_dtype"] = str(dtype or model.embed.weight.dtype).removeprefix("torch.")
    if fp8:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        if scale_fmt:
            cfg["quantization_config"]["scale_fmt"] = scale_fmt
    write_folder(path, out, cfg, max_shard_bytes, sorted(out, key=_key_order))


def write_folder(path: Path, tensors: dict[str, torch.Tensor], cfg: dict, max_shard_bytes: int,
                 order: list[str]) -> None:
    """An HF checkpoint folder (V3's and V4's savers): ``tensors`` in shards of at most ``max_shard_bytes`` (a
    larger tensor alone), in ``order``, their index, ``cfg`` as config.json, the shards readable as config.json is
    (safetensors creates its files 0600)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in order:
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    mode = stat.S_IMODE((path / "config.json").stat().st_mode)
    for file in set(weight_map.values()):
        os.chmod(path / file, mode)


def _key_order(key: str) -> tuple[int, str]:
    """Layer-major order, so a pipeline stage's layers sit in few shards."""
    parts = key.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else (-1 if "embed" in key else 10**9)
    return layer, key
