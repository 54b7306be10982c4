"""System files: what the planner knows about a GPU and its links, as JSON.

A system file holds the device's dense peaks and memory, per-class kernel efficiencies (the share of
the peak a kernel class reaches), per-shape efficiency tables (``"MxNxK"`` per group, one number or one
per pass ``{"f", "i", "w"}``: forward, input gradient, weight gradient), the two links (inside a node,
between nodes) with bandwidth and latency, collective efficiencies, the all-to-all's fixed cost per call
by group size, the per-node step-time jitter (stragglers), the fixed cost of a memory-bound kernel and the
share of SMs the all-to-all takes while it overlaps computation. Every figure names its source in
``sources`` (keys ``efficiency.<class>``, ``shape_efficiency.<class>``, ``all_to_all_latency_us``, ``jitter_cv``,
``memory_latency_us``, ...; a term left at 0 needs none); a file without one is refused.
Files shipped in ``systems/`` take their figures from public measurements and are marked
``"calibrated": false``; ``recipes.plan calibrate`` writes measured ones.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMS_DIR = Path(__file__).parent / "systems"
KERNEL_CLASSES = ("gemm", "grouped_gemm", "fp8_gemm", "fp8_grouped_gemm", "mxfp8_gemm", "mxfp8_grouped_gemm",
                  "attention_fwd", "attention_bwd", "memory", "permute", "cross_entropy")
LOW_PRECISION = ("fp8_", "mxfp8_")  # classes that may be 0: the device has no such tensor-core path
PASSES = ("f", "i", "w")
SOURCED = ("peaks", "links", "collective_efficiency", "comm_sm_fraction", "all_to_all_latency_us", "jitter_cv",
           "memory_latency_us")
COLLECTIVES = ("all_to_all", "ring", "p2p")


@dataclass(frozen=True)
class Link:
    bandwidth_gb_s: float  # per GPU, per direction
    latency_us: float

    def seconds(self, nbytes: float, efficiency: float = 1.0) -> float:
        """Time to move ``nbytes`` over this link: latency + bytes / (bandwidth x efficiency)."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9 * efficiency)


@dataclass(frozen=True)
class System:
    name: str
    calibrated: bool
    bf16_tflops: float
    fp8_tflops: float  # 0: no FP8 tensor cores
    memory_gbps: float
    memory_gib: float
    efficiency: dict[str, float]
    intra_node: Link
    inter_node: Link
    collective_efficiency: dict[str, float]
    comm_sm_fraction: float
    gpus_per_node: int
    shape_efficiency: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # class: shape: pass
    sources: dict[str, str] = field(default_factory=dict)
    all_to_all_latency_us: dict[int, float] = field(default_factory=dict)  # fixed cost of one call, by group size
    jitter_cv: float = 0.0  # per-node step-time coefficient of variation (stragglers)
    memory_latency_us: float = 0.0  # fixed cost of one memory-bound kernel (launch, tail), per pass
    action_overhead_us: float = 0.0  # host time the runtime adds to each computation pass (calibrated)
    send_overhead_us: float = 0.0  # host time to post one P2P message
    recv_overhead_us: float = 0.0  # host time to take one arrived P2P message

    @property
    def capacity_bytes(self) -> float:
        return self.memory_gib * 1024**3

    def kernel_efficiency(self, kind: str, shape: str | None = None, pass_: str = "f") -> float:
        """Efficiency of ``kind`` at ``shape`` (``"MxNxK"``) in ``pass_`` (f, i, w): the file's figure for that
        shape; else, where the file measured the same ``NxK`` at other row counts ``M``, the figure at the largest
        of them not above ``M`` (the smallest when all are above): a GEMM's efficiency grows with its rows, so
        this errs slow; else the class's. (A grouped GEMM with 8192 rows per expert, EP64 on the full V3, is
        not the class median of mostly 128-1024-row shapes.)"""
        if shape is not None:
            table = self.shape_efficiency.get(kind, {})
            measured = table.get(shape)
            if measured is None:
                rows, _, nk = shape.partition("x")
                same = self._rows_by_nk.get(kind, {}).get(nk)
                if same and rows.isdigit():
                    below = [m for m in same if m <= int(rows)]
                    measured = table[f"{max(below) if below else same[0]}x{nk}"]
            if measured is not None:
                return measured[pass_]
        return self.efficiency[kind]

    @functools.cached_property
    def _rows_by_nk(self) -> dict[str, dict[str, list[int]]]:
        """class -> ``NxK`` -> the sorted row counts ``M`` the file measured it at."""
        out: dict[str, dict[str, list[int]]] = {}
        for kind, table in self.shape_efficiency.items():
            for shape in table:
                rows, _, nk = shape.partition("x")
                if rows.isdigit():
                    out.setdefault(kind, {}).setdefault(nk, []).append(int(rows))
        return {k: {nk: sorted(v) for nk, v in t.items()} for k, t in out.items()}

    def all_to_all_latency(self, group: int) -> float:
        """Fixed seconds of one all-to-all call over ``group`` ranks: the figure of the largest group size in
        the file not above ``group`` (the smallest one below all of them)."""
        if group <= 1 or not self.all_to_all_latency_us:
            return 0.0
        sizes = sorted(self.all_to_all_latency_us)
        return self.all_to_all_latency_us[max([n for n in sizes if n <= group], default=sizes[0])] * 1e-6

    def to_json(self) -> dict:
        return {"name": self.name, "calibrated": self.calibrated,
                "gpu": {"bf16_tflops": self.bf16_tflops, "fp8_tflops": self.fp8_tflops,
                        "memory_gbps": self.memory_gbps, "memory_gib": self.memory_gib},
                "efficiency": dict(self.efficiency), "shape_efficiency": self.shape_efficiency,
                "links": {k: {"bandwidth_gb_s": v.bandwidth_gb_s, "latency_us": v.latency_us}
                          for k, v in (("intra_node", self.intra_node), ("inter_node", self.inter_node))},
                "collective_efficiency": dict(self.collective_efficiency), "comm_sm_fraction": self.comm_sm_fraction,
                "gpus_per_node": self.gpus_per_node, "action_overhead_us": self.action_overhead_us,
                "all_to_all_latency_us": {str(k): v for k, v in self.all_to_all_latency_us.items()},
                "jitter_cv": self.jitter_cv, "memory_latency_us": self.memory_latency_us,
                "send_overhead_us": self.send_overhead_us, "recv_overhead_us": self.recv_overhead_us,
                "sources": self.sources}


def known_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.json"))


def _get(table: dict, key: str, where: str, kind: type | tuple[type, ...] = (int, float)):
    if not isinstance(table, dict) or key not in table:
        raise ValueError(f"{where}: missing key '{key}'")
    value = table[key]
    if kind == (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where}: '{key}' must be a number, got {value!r}")
    if kind != (int, float) and not isinstance(value, kind):
        raise ValueError(f"{where}: '{key}' must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _positive(value: float, what: str, upper: float | None = None) -> float:
    if not 0 < value < math.inf or (upper is not None and value > upper):
        bound = f"in (0, {upper}]" if upper is not None else "> 0"
        raise ValueError(f"{what} must be {bound}, got {value!r}")
    return float(value)


def _non_negative(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{what} must be a number >= 0, got {value!r}")
    return float(value)


def _shape_tables(shapes: object, where: str) -> dict[str, dict[str, dict[str, float]]]:
    """``{class: {"MxNxK": e | {"f": e, "i": e, "w": e}}}`` with every number in (0, 1], as per-pass dicts."""
    if not isinstance(shapes, dict):
        raise ValueError(f"{where}: 'shape_efficiency' must map kernel classes to {{shape: efficiency}}")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind, table in shapes.items():
        if kind not in KERNEL_CLASSES or not isinstance(table, dict):
            raise ValueError(f"{where}: shape_efficiency.{kind}: expected one of {KERNEL_CLASSES} mapping shapes "
                             "to efficiencies")
        out[kind] = {}
        for shape, value in table.items():
            what = f"{where}: shape_efficiency.{kind}.{shape}"
            per_pass = value if isinstance(value, dict) else dict.fromkeys(PASSES, value)
            if set(per_pass) != set(PASSES):
                raise ValueError(f"{what} must be a number or {{'f', 'i', 'w'}}, got {value!r}")
            out[kind][shape] = {p: _positive(_number(per_pass[p], f"{what}.{p}"), f"{what}.{p}", 1.0) for p in PASSES}
    return out


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


def system_from_json(doc: dict, where: str = "system file") -> System:
    """Validate a parsed system file; ValueError naming the file and the key for anything malformed."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    gpu = _get(doc, "gpu", where, dict)
    eff = _get(doc, "efficiency", where, dict)
    links = _get(doc, "links", where, dict)
    coll = _get(doc, "collective_efficiency", where, dict)
    fp8 = _non_negative(_get(gpu, "fp8_tflops", f"{where} [gpu]"), f"{where}: gpu.fp8_tflops")  # 0: no FP8 path
    sources = _get(doc, "sources", where, dict)
    efficiency = {}
    for k in KERNEL_CLASSES:
        value = float(_get(eff, k, f"{where} [efficiency]"))
        if k.startswith(LOW_PRECISION) and (fp8 == 0.0 or value == 0.0):  # 0: no such tensor-core path
            efficiency[k] = _non_negative(value, f"{where}: efficiency.{k}")
            continue
        efficiency[k] = _positive(value, f"{where}: efficiency.{k}", 1.0)
    shapes = _shape_tables(doc.get("shape_efficiency", {}), where)
    a2a = doc.get("all_to_all_latency_us", {})
    if not isinstance(a2a, dict) or any(not str(n).isdigit() or int(n) < 2 for n in a2a):
        raise ValueError(f"{where}: 'all_to_all_latency_us' must map group sizes >= 2 to microseconds, got {a2a!r}")
    needed = ([f"efficiency.{k}" for k, v in efficiency.items() if v > 0] + [f"shape_efficiency.{k}" for k in shapes]
              + [k for k in SOURCED if doc.get(k) or k in ("peaks", "links")])  # a term at 0 or {} needs none
    for key in needed:
        if not isinstance(sources.get(key), str) or not sources[key].strip():
            raise ValueError(f"{where}: sources.{key} missing: every figure of a system file names its source")
    link = {}
    for k in ("intra_node", "inter_node"):
        t = _get(links, k, f"{where} [links]", dict)
        bandwidth = _get(t, "bandwidth_gb_s", f"{where} [links.{k}]")
        link[k] = Link(_positive(bandwidth, f"{where}: links.{k}.bandwidth_gb_s"),
                       _non_negative(_get(t, "latency_us", f"{where} [links.{k}]"), f"{where}: links.{k}.latency_us"))
    comm_sm = _number(_get(doc, "comm_sm_fraction", where), f"{where}: comm_sm_fraction")
    if not 0 <= comm_sm < 1:  # the computation that overlaps the all-to-all keeps 1 - fraction of the SMs
        raise ValueError(f"{where}: comm_sm_fraction must be in [0, 1), got {comm_sm!r}")
    gpus_per_node = _get(doc, "gpus_per_node", where, int)
    if isinstance(gpus_per_node, bool) or gpus_per_node < 1:
        raise ValueError(f"{where}: gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    return System(
        name=str(_get(doc, "name", where, str)),
        calibrated=bool(_get(doc, "calibrated", where, bool)),
        bf16_tflops=_positive(_get(gpu, "bf16_tflops", f"{where} [gpu]"), f"{where}: gpu.bf16_tflops"),
        fp8_tflops=fp8,
        memory_gbps=_positive(_get(gpu, "memory_gbps", f"{where} [gpu]"), f"{where}: gpu.memory_gbps"),
        memory_gib=_positive(_get(gpu, "memory_gib", f"{where} [gpu]"), f"{where}: gpu.memory_gib"),
        efficiency=efficiency,
        intra_node=link["intra_node"], inter_node=link["inter_node"],
        collective_efficiency={k: _positive(_get(coll, k, f"{where} [collective_efficiency]"),
                                            f"{where}: collective_efficiency.{k}", 2.0) for k in COLLECTIVES},
        comm_sm_fraction=comm_sm,
        gpus_per_node=gpus_per_node,
        shape_efficiency=shapes,
        sources=dict(sources),
        all_to_all_latency_us={int(n): _non_negative(v, f"{where}: all_to_all_latency_us.{n}") for n, v in a2a.items()},
        jitter_cv=_non_negative(doc.get("jitter_cv", 0.0), f"{where}: jitter_cv"),
        memory_latency_us=_non_negative(doc.get("memory_latency_us", 0.0), f"{where}: memory_latency_us"),
        **{k: _non_negative(doc.get(k, 0.0), f"{where}: {k}")
           for k in ("action_overhead_us", "send_overhead_us", "recv_overhead_us")},
    )


def load_system(name_or_path: str) -> System:
    """A shipped system by GPU name (``H800``, ``MTT-S5000``, case-insensitive) or a system file path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"--system: no such file {str(path)!r}")
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--system {str(path)!r}: not valid JSON: {exc}") from None
        return system_from_json(doc, f"system file {str(path)!r}")
    names = {n.upper(): n for n in known_systems()}
    key = name_or_path.upper().replace(" ", "-").replace("_", "-")
    if key not in names:
        close = difflib.get_close_matches(key, list(names), n=1)
        hint = f"; did you mean {names[close[0]]}?" if close else ""
        raise ValueError(f"--gpu: unknown GPU {name_or_path!r}; expected one of {', '.join(known_systems())} "
                         f"or a system file (--system FILE.json){hint}")
    file = SYSTEMS_DIR / f"{names[key]}.json"
    return system_from_json(json.loads(file.read_text()), f"system file {file.name!r}")
