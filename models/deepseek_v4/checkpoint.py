"""DeepSeek-V4 checkpoints both ways: transformers' ``DeepseekV4`` layout and DeepSeek's released layout.

- transformers' layout: ``model.layers.N.self_attn.q_a_proj.weight`` ..., routed experts as
  ``mlp.experts.gate_up_proj`` / ``down_proj`` ``[E, ...]`` tensors; MTP (which transformers does not build) under
  the release's ``mtp.K.*`` names, which transformers skips on load. Written unquantised.
- DeepSeek's released layout: our own names (``embed``, ``layers.N.attn.wq_a``, ``hc_attn_fn``, ``attn_sink``,
  ``ape``, ``mtp.0.*``) with one ``ffn.experts.E.w{1,2,3}`` per routed expert. Quantised (``quantize=True``) as
  released: the block GEMM weights (``FP8_LINEARS``) in e4m3 with a UE8M0 (``float8_e8m0fnu``) ``.scale`` per
  128x128 block, routed experts in MXFP4 (two e2m1 values per byte, low nibble first, an E8M0 scale per 32
  along the input dimension), the compressors, indexer weights projection, ``wo_a``, router, embedding, head and
  norms in BF16, and the mHC parameters, sinks, position biases and router bias in FP32.

Loading reads either layout (told apart by its keys), dequantises FP8 (``.scale`` or transformers'
``weight_scale_inv``) and MXFP4 weights, and checks every key, shape and dtype: an unknown, missing or
misshapen tensor is a ValueError naming the key and what was expected.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import torch

import deep_gemm
from models.deepseek_v3.checkpoint import open_shard, read_index, write_folder
from models.deepseek_v3.moe import Experts as V3Experts
from models.deepseek_v4.args import ModelArgs
from models.deepseek_v4.model import Transformer
from models.deepseek_v4.names import hf_name, our_name, release_expert_names, release_name

LAYOUTS = ("transformers", "release")
FP8_BLOCK = 128
MXFP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# released in e4m3 + UE8M0 128x128 scales (by our name's ending); the rest of the 2-D weights stay BF16
FP8_LINEARS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|[eh]_proj)\.weight$")
SHARED_COPIES = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")  # copies of the shared embedding / head
FP32_TENSORS = re.compile(r"(hc_\w+_(fn|base|scale)|attn_sink|\.ape|gate\.bias)$")


# ---------------------------------------------------------------------------------------------------- formats
def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    """e4m3 ``weight [n, k]`` times its per-128x128-block ``scale [ceil(n/128), ceil(k/128)]`` (fp32 or E8M0)."""
    n, k = weight.shape
    want = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"{key}: FP8 scale of shape {tuple(scale.shape)}; expected {want} for a {(n, k)} weight")
    full = scale.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.float() * full


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [n, k]`` -> (packed ``float4_e2m1fn_x2 [n, k/2]``, E8M0 scales ``[n, k/32]``), the OCP MX rule: per 32
    values ``s = 2^(floor(log2(amax)) - 2)`` (e2m1's largest exponent), each value the nearest e2m1 of ``w / s``
    saturated at +-6. Quantising dequantised weights gives back the same bits (the block maximum stays in
    ``[4 s, 8 s)``), so a loaded checkpoint is written back as it was."""
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_BLOCK}, got {k}")
    blocks = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax.clamp_min(2.0 ** -125))) - 2).clamp(2.0 ** -127, 2.0 ** 127)
    grid = torch.tensor(E2M1_VALUES)
    scaled = (blocks / scale).clamp(-6.0, 6.0)
    code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)  # nearest magnitude (ties: the smaller)
    code = (code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3).to(torch.uint8).view(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.float4_e2m1fn_x2), scale.view(n, -1).to(torch.float8_e8m0fnu)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    """Packed e2m1 pairs ``[n, k/2]`` (``float4_e2m1fn_x2``, int8 or uint8) times E8M0 ``scale [n, k/32]``."""
    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // MXFP4_BLOCK):
        raise ValueError(f"{key}: MXFP4 scale of shape {tuple(scale.shape)}; expected {(n, 2 * half // MXFP4_BLOCK)}")
    byte = packed.contiguous().view(torch.uint8).long()
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    values = torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=-1).view(n, -1, MXFP4_BLOCK)
    return (values * scale.float().unsqueeze(-1)).view(n, 2 * half)


def _is_fp4(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8)


# ---------------------------------------------------------------------------------------------------- plan
def _tensors(model: Transformer) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def _held_experts(model: Transformer) -> dict[str, list[int]]:
    """For the routed-expert tensors of an expert-parallel model (``Transformer(args, expert_ids)``): the global
    expert of each row (``Experts.expert_ids``). A model holding every expert has none."""
    held = {}
    for prefix, m in model.named_modules():
        if isinstance(m, V3Experts) and len(m.expert_ids) != model.args.n_routed_experts:
            for leaf in ("w13", "w2"):
                held[f"{prefix}.{leaf}"] = list(m.expert_ids)
    return held


def checkpoint_plan(model: Transformer, layout: str) -> dict[str, list[tuple[str | tuple[str, ...], int | None]]]:
    """For each of our tensors: ``(checkpoint key(s), expert)`` pieces -- one key for a whole tensor, or per
    routed expert the release's keys whose rows are stacked into that expert's slice (w13 = w1 rows, w3 rows)."""
    plan: dict[str, list] = {}
    for name, t in _tensors(model).items():
        if layout == "transformers":
            key = hf_name(name)
            plan[name] = [(key if key is not None else name, None)]
            continue
        experts = release_expert_names(name, t.shape[0])
        plan[name] = ([(keys, e) for e, keys in enumerate(experts)] if experts is not None
                      else [(release_name(name), None)])
    return plan


# ---------------------------------------------------------------------------------------------------- load
def checkpoint_layout(weight_map: dict[str, str]) -> str:
    """``"transformers"`` when the keys are transformers' (``model.*`` / ``lm_head.*``), else ``"release"``."""
    return "transformers" if any(k.startswith(("model.", "lm_head.")) for k in weight_map) else "release"


def _scale_key(key: str, weight_map: dict[str, str]) -> str | None:
    for cand in (key[: -len(".weight")] + ".scale" if key.endswith(".weight") else None, key + "_scale_inv"):
        if cand is not None and cand in weight_map:
            return cand
    return None


def load_hf_checkpoint(model_or_args: Transformer | ModelArgs | None, path: str | Path, *,
                       device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                       strict: bool = True) -> Transformer:
    """Load a V4 checkpoint folder (either layout) into a model and return it.

    ``model_or_args``: a ``Transformer`` (filled in place), a ``ModelArgs`` or None (read ``config.json``); a
    model built here lives on ``device`` in ``dtype`` (default fp32; ``FP32_TENSORS`` stay fp32, as released),
    and has no MTP layers when the checkpoint holds none (transformers' own saves). ``strict``: unknown keys
    are an error. A given model may be one training rank's part (``model.init_from``): tensors on ``meta`` (other
    pipeline stages) are left alone, and an expert-parallel model's routed experts (``Experts.expert_ids``) take
    their own experts' rows only.
    """
    path = Path(path)
    weight_map = read_index(path)
    layout = checkpoint_layout(weight_map)
    if isinstance(model_or_args, Transformer):
        model = model_or_args
    else:
        args = model_or_args if isinstance(model_or_args, ModelArgs) else ModelArgs.from_hf_config(path)
        if args.n_mtp_layers and not any(k.startswith("mtp.") for k in weight_map):
            args = args.replace(n_mtp_layers=0)
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device=device)
        if dtype is not None:
            model.to(dtype)
            with torch.no_grad():  # mHC parameters, sinks, position biases and the router bias stay fp32
                for name, t in _tensors(model).items():
                    if FP32_TENSORS.search(name) and t.is_floating_point():
                        t.data = t.data.float()
    tensors = _tensors(model)
    held = _held_experts(model)
    scales = {k for k in weight_map
              if k.endswith("_scale_inv") or (k.endswith(".scale") and k[: -len(".scale")] + ".weight" in weight_map)}
    wanted: dict[str, tuple[torch.Tensor, list[int] | None]] = {}  # checkpoint key -> destination, expert rows
    filled: dict[str, set] = defaultdict(set)  # our tensor -> {None} (whole) or {(local expert, part), ...}
    unknown = []
    for key in weight_map:
        if key in scales or SHARED_COPIES.match(key):
            continue
        where = our_name(key)
        if where is None or where[0] not in tensors:
            unknown.append(key)
            continue
        name, expert, part = where
        dst, ids = tensors[name], held.get(name)
        if expert is not None:
            if expert >= (dst.shape[0] if ids is None else model.args.n_routed_experts):
                unknown.append(key)
                continue
            if ids is not None and expert not in ids:  # another expert-parallel rank's expert
                continue
            expert = expert if ids is None else ids.index(expert)
        if dst.is_meta:  # another pipeline stage's tensor
            continue
        rows = ids if expert is None and ids is not None else None  # a whole [E, ...] tensor: this rank's rows
        if expert is not None:
            dst = dst[expert]
            if name.endswith(".w13"):  # w1 rows then w3 rows
                dst = dst.narrow(0, part * (dst.shape[0] // 2), dst.shape[0] // 2)
        wanted[key] = (dst, rows)
        filled[name].add(None if expert is None else (expert, part))
    missing = []
    for name, t in tensors.items():
        got = filled.get(name, set())
        if None in got or t.is_meta:
            continue
        if got and name.endswith((".experts.w13", ".experts.w2")):
            parts = (0, 1) if name.endswith(".w13") else (0,)
            gaps = [(e, p) for e in range(t.shape[0]) for p in parts if (e, p) not in got]
            if not gaps:
                continue
            e, p = gaps[0]
            ids = held.get(name)
            keys = release_expert_names(name, model.args.n_routed_experts)[e if ids is None else ids[e]]
            missing.append(f"{keys[p]} (expected shape {(t.shape[1] // len(parts), t.shape[2])})")
            continue
        key = (hf_name(name) or name) if layout == "transformers" else release_name(name)
        missing.append(f"{key} (expected shape {tuple(t.shape)})")
    if missing:
        raise ValueError(f"load_hf_checkpoint: {len(missing)} tensor(s) missing from {path} ({layout} layout): "
                         f"{', '.join(sorted(missing)[:5])}")
    if strict and unknown:
        raise ValueError(f"load_hf_checkpoint: {len(unknown)} unexpected key(s) in {path} for this config "
                         f"({layout} layout), e.g. {sorted(unknown)[:5]}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for k in wanted:
        by_file[weight_map[k]].append(k)
    with torch.no_grad():
        for file, keys in sorted(by_file.items()):
            with open_shard(path / file) as f:
                for key in keys:
                    dst, rows = wanted[key]
                    src = _read(f, key, dst, weight_map, path)
                    if rows is not None and src.dim() == dst.dim() and src.shape[0] == model.args.n_routed_experts:
                        src = src[rows]
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(f"load_hf_checkpoint: {key} has shape {tuple(src.shape)}; expected "
                                         f"{tuple(dst.shape)}")
                    dst.copy_(src)
    return model


def _read(f, key: str, dst: torch.Tensor, weight_map: dict[str, str], path: Path) -> torch.Tensor:
    """One checkpoint tensor as values: FP8 and MXFP4 weights dequantised with their scales."""
    src = f.get_tensor(key)
    if not dst.is_floating_point():  # the hash routing table
        if src.is_floating_point() or src.dtype == torch.bool:
            raise ValueError(f"load_hf_checkpoint: {key} has dtype {src.dtype}; expected integer expert ids")
        return src
    quantized = src.dtype == torch.float8_e4m3fn or _is_fp4(src)
    if not quantized:
        if not src.is_floating_point():
            raise ValueError(f"load_hf_checkpoint: {key} has dtype {src.dtype}; expected a floating dtype")
        return src
    scale_key = _scale_key(key, weight_map)
    if scale_key is None:
        raise ValueError(f"load_hf_checkpoint: {key} is quantised ({src.dtype}) but has no .scale / _scale_inv")
    with open_shard(path / weight_map[scale_key]) as g:
        scale = g.get_tensor(scale_key)
    if src.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(src, scale, key)
    return dequantize_mxfp4(src, scale, key)


# ---------------------------------------------------------------------------------------------------- save
def save_hf_checkpoint(model: Transformer, path: str | Path, *, layout: str = "transformers",
                       dtype: torch.dtype | None = None, quantize: bool = False,
                       max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``model`` as a V4 checkpoint folder (config.json, safetensors shards, index) in ``layout``.

    Tensors keep their dtype unless ``dtype`` (bfloat16 or float32) is given. ``quantize`` (release layout
    only) writes DeepSeek's released formats: ``FP8_LINEARS`` in e4m3 + UE8M0 128x128 ``.scale``, routed
    experts in MXFP4, ``FP32_TENSORS`` in fp32, everything else in BF16 (``dtype`` default)."""
    if layout not in LAYOUTS:
        raise ValueError(f"save_hf_checkpoint: layout must be one of {LAYOUTS}, got {layout!r}")
    if quantize and layout != "release":
        raise ValueError("save_hf_checkpoint: quantize=True writes DeepSeek's released formats; use layout='release'")
    if dtype not in (None, torch.bfloat16, torch.float32):
        raise ValueError(f"save_hf_checkpoint: dtype must be bfloat16 or float32, got {dtype}")
    if quantize and dtype is None:
        dtype = torch.bfloat16
    if any(t.is_meta for t in _tensors(model).values()):
        raise ValueError("save_hf_checkpoint: the model has tensors on the meta device; save needs the whole model")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    tensors = _tensors(model)
    for name, pieces in checkpoint_plan(model, layout).items():
        t = tensors[name].detach()
        for keys, expert in pieces:
            if isinstance(keys, str):
                _put(out, keys, name, t, dtype, quantize, expert=False)
                continue
            value = t[expert]
            for i, key in enumerate(keys):
                rows = value.shape[0] // len(keys)
                _put(out, key, name, value.narrow(0, i * rows, rows), dtype, quantize, expert=True)
    cfg = model.args.to_hf_config()
    cfg["torch_dtype"] = str(dtype or model.embed.weight.dtype).removeprefix("torch.")
    if quantize:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                      "expert_dtype": "fp4"}
    write_folder(path, out, cfg, max_shard_bytes, sorted(out))


def _put(out: dict[str, torch.Tensor], key: str, name: str, value: torch.Tensor, dtype: torch.dtype | None,
         quantize: bool, expert: bool) -> None:
    if quantize and expert:
        out[key], out[key[: -len(".weight")] + ".scale"] = quantize_mxfp4(value)
        return
    if quantize and FP8_LINEARS.search(name):
        weight, scale = deep_gemm.per_block_cast_to_fp8(value.float(), use_ue8m0=True)
        out[key], out[key[: -len(".weight")] + ".scale"] = weight, scale.to(torch.float8_e8m0fnu)
        return
    if not value.is_floating_point():
        value = value.to(torch.int32) if quantize else value
    elif quantize and FP32_TENSORS.search(name):
        value = value.float()
    elif dtype is not None and not name.endswith("gate.bias"):
        value = value.to(dtype)
    out[key] = value.contiguous().cpu().clone()
