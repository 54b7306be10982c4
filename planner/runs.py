"""Public real training runs as data: ``benchmarks/planner_runs/*.toml``, one measured run per file.

Each record names its source (repository, file or issue, commit or date, and the figures read there), the system
(a shipped system file) and GPU count, the model (a preset plus ``recipes.train --set`` overrides), the layout in
Megatron's terms (TP, PP, VPP, EP, DP, CP, micro-batch, global batch, sequence length, schedule, recompute,
precision, optimizer moments, ZeRO-1, FSDP, and whether the source's runtime overlaps one micro-batch's EP
all-to-all with another's compute outside the schedule, as Megatron's ``overlap_moe_expert_parallel_comm`` does),
the routing (forced-balanced, natural, or unstated by the source) and
what was measured (step time or tokens/s per GPU) and how. A run whose layout or model the planner cannot express
carries ``run.excluded`` with the reason; it stays on record and out of the fit. Runs sharing ``run.group`` repeat
one layout (a resumed run, a rerun) and are left out together. The schema is in the folder's README.md;
``load_runs`` refuses a bad record with one line naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

from planner.search import Layout, Request
from planner.system import known_systems, load_system
from training.config import TrainConfig

RUNS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "planner_runs"
ROUTING = ("balanced", "natural", "unstated")
MEASURED = ("step_time_ms", "tokens_per_s_per_gpu")
PRECISION = {"bf16": None, "fp8-blockwise": "blockwise", "mxfp8": "mxfp8"}  # -> the planner's FP8 recipe
MOMENTS = {"fp32": "param", "bf16": "bfloat16"}  # -> Layout.moments (param = the FP32 masters' dtype)
SCHEDULES = ("none", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipe", "dualpipev")
PLANNER_SCHEDULE = {"interleaved-1f1b": "interleaved1f1b"}  # Megatron's name -> the schedule IR's
RECOMPUTE = ("none", "v3", "block", "other")
# GPU families: the nearest runs of a question are those of its family (same architecture generation)
FAMILIES = {"A100": "Ampere", "H100": "Hopper", "H800": "Hopper", "H200": "Hopper", "B200": "Blackwell",
            "GB200": "Blackwell", "B300": "Blackwell Ultra", "GB300": "Blackwell Ultra", "MTT-S4000": "MUSA",
            "MTT-S5000": "MUSA"}
_INT_KEYS = ("tp", "pp", "vpp", "ep", "dp", "cp", "micro_batch", "global_batch", "seq_len")
_SECTIONS = {
    "source": {"repository": str, "file": str, "commit": str, "date": str, "reads": str},
    "system": {"gpu": str, "gpus": int},
    "model": {"name": str, "preset": str, "sets": list},
    "layout": {**dict.fromkeys(_INT_KEYS, int), "schedule": str, "recompute": str, "precision": str, "moments": str,
               "zero1": bool, "fsdp": bool, "ep_overlap": bool},
    "run": {"routing": str, "measured": str, "value": float, "how": str, "group": str, "excluded": str},
}
_OPTIONAL = {("layout", "ep_overlap"), ("source", "commit"), ("source", "date"), ("model", "preset"),
             ("model", "sets"), ("run", "group"), ("run", "excluded")}


def family(gpu: str) -> str:
    """The GPU generation of a shipped system name (its own name where none is listed)."""
    return FAMILIES.get(gpu, gpu)


@dataclass(frozen=True)
class Run:
    """One public measured run (see the module docstring)."""

    name: str
    source: dict
    gpu: str
    gpus: int
    model: str
    preset: str | None
    sets: tuple[str, ...]
    layout: dict
    routing: str
    measured: str
    value: float
    how: str
    group: str
    excluded: str

    @property
    def family(self) -> str:
        return family(self.gpu)

    @property
    def measured_step_s(self) -> float:
        """The measured step time; from tokens/s per GPU as global batch x seq / (that x GPUs)."""
        if self.measured == "step_time_ms":
            return self.value / 1e3
        return self.layout["global_batch"] * self.layout["seq_len"] / (self.value * self.gpus)

    def planner_layout(self) -> Layout:
        """The run's layout in the planner's terms (only for runs that are not excluded)."""
        lay = self.layout
        return Layout(lay["pp"], lay["dp"], lay["ep"], PLANNER_SCHEDULE.get(lay["schedule"], lay["schedule"]),
                      lay["micro_batch"], lay["global_batch"] // (lay["dp"] * lay["micro_batch"]), lay["recompute"],
                      fp8=lay["precision"] != "bf16", moments=MOMENTS[lay["moments"]], zero1=lay["zero1"],
                      vpp=lay["vpp"])

    def request(self, base: TrainConfig, terms: frozenset[str] | None = None) -> Request:
        """The planner's question for this run (``base``: its model as a training config)."""
        extra = {} if terms is None else {"terms": terms}
        return Request(base, load_system(self.gpu), self.gpus, self.layout["seq_len"], self.layout["global_batch"],
                       fp8_recipe=PRECISION[self.layout["precision"]] or "blockwise", **extra)


def _field(doc: dict, section: str, key: str, kind: type, where: str):
    table = doc.get(section)
    if not isinstance(table, dict):
        raise ValueError(f"{where}: missing section [{section}]")
    if key not in table:
        if (section, key) in _OPTIONAL:
            return None
        raise ValueError(f"{where}: missing key {section}.{key}")
    value = table[key]
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
          else isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, kind))
    if not ok:
        raise ValueError(f"{where}: {section}.{key} must be {kind.__name__}, got {value!r}")
    if kind is str and not value.strip():
        raise ValueError(f"{where}: {section}.{key} must not be empty")
    return value


def _choice(value: str, choices, what: str, where: str) -> str:
    if value not in choices:
        raise ValueError(f"{where}: {what} must be one of {', '.join(choices)}, got {value!r}")
    return value


def run_from_toml(doc: dict, name: str, where: str) -> Run:
    """Validate one parsed record; ValueError (one line, naming ``where`` and the key) for anything malformed."""
    for section, table in doc.items():
        if section not in _SECTIONS or not isinstance(table, dict):
            raise ValueError(f"{where}: unknown section [{section}]; expected {', '.join(_SECTIONS)}")
        extra = set(table) - set(_SECTIONS[section])
        if extra:
            raise ValueError(f"{where}: unknown key {section}.{sorted(extra)[0]}; expected some of "
                             f"{', '.join(_SECTIONS[section])}")
    get = {(s, k): _field(doc, s, k, kind, where) for s, keys in _SECTIONS.items() for k, kind in keys.items()}
    if get["source", "commit"] is None and get["source", "date"] is None:
        raise ValueError(f"{where}: source needs a commit or a date")
    gpu = _choice(get["system", "gpu"], known_systems(), "system.gpu", where)
    if get["system", "gpus"] < 1:
        raise ValueError(f"{where}: system.gpus must be >= 1, got {get['system', 'gpus']}")
    layout = {k: get["layout", k] for k in _SECTIONS["layout"]}
    layout["ep_overlap"] = bool(layout["ep_overlap"])
    for k in _INT_KEYS:
        if layout[k] < 1:
            raise ValueError(f"{where}: layout.{k} must be a positive integer, got {layout[k]}")
    _choice(layout["schedule"], SCHEDULES, "layout.schedule", where)
    _choice(layout["recompute"], RECOMPUTE, "layout.recompute", where)
    _choice(layout["precision"], tuple(PRECISION), "layout.precision", where)
    _choice(layout["moments"], tuple(MOMENTS), "layout.moments", where)
    model_parallel = layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"]
    if model_parallel != get["system", "gpus"]:
        raise ValueError(f"{where}: layout tp x pp x cp x dp = {model_parallel} != system.gpus "
                         f"{get['system', 'gpus']}")
    if layout["dp"] % layout["ep"] and layout["ep"] % layout["dp"]:
        raise ValueError(f"{where}: layout.ep {layout['ep']} and layout.dp {layout['dp']}: one must divide the other")
    if layout["global_batch"] % (layout["dp"] * layout["micro_batch"]):
        raise ValueError(f"{where}: layout.global_batch {layout['global_batch']} is not a multiple of dp x "
                         f"micro_batch = {layout['dp'] * layout['micro_batch']}")
    if not get["run", "value"] > 0:
        raise ValueError(f"{where}: run.value must be > 0, got {get['run', 'value']}")
    _choice(get["run", "routing"], ROUTING, "run.routing", where)
    _choice(get["run", "measured"], MEASURED, "run.measured", where)
    sets = get["model", "sets"] or []
    if any(not isinstance(s, str) or "=" not in s for s in sets):
        raise ValueError(f"{where}: model.sets must be a list of 'key=value' strings, got {sets!r}")
    excluded = get["run", "excluded"] or ""
    if not excluded and get["model", "preset"] is None:
        raise ValueError(f"{where}: model.preset is needed unless run.excluded says why the planner cannot model it")
    if (layout["vpp"] > 1) != (layout["schedule"] == "interleaved-1f1b"):
        raise ValueError(f"{where}: layout.vpp {layout['vpp']} with layout.schedule {layout['schedule']!r}: virtual "
                         "pipeline stages (vpp > 1) go with interleaved-1f1b and only with it")
    if not excluded and (layout["tp"] > 1 or layout["cp"] > 1 or layout["fsdp"] or layout["recompute"] == "other"):
        raise ValueError(f"{where}: the layout uses TP, CP, FSDP or another recompute, which the planner "
                         "does not model: run.excluded must say so")
    return Run(name, {k: v for (s, k), v in get.items() if s == "source" and v is not None}, gpu,
               get["system", "gpus"], get["model", "name"], get["model", "preset"], tuple(sets), layout,
               get["run", "routing"], get["run", "measured"], float(get["run", "value"]), get["run", "how"],
               get["run", "group"] or name, excluded)


def load_run(path: Path) -> Run:
    """One record file; ValueError naming the file for anything malformed."""
    where = str(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid TOML: {str(exc).splitlines()[0]}") from None
    return run_from_toml(doc, path.stem, where)


def load_runs(folder: Path = RUNS_DIR) -> list[Run]:
    """Every record of ``folder`` (``*.toml``), sorted by name."""
    if not folder.is_dir():
        raise ValueError(f"runs folder {str(folder)!r}: no such directory")
    return [load_run(p) for p in sorted(folder.glob("*.toml"))]
