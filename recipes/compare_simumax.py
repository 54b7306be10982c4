"""Side by side with SimuMax: ``python -m recipes.compare_simumax --simumax PATH [--python PY]``.

Runs our planner and SimuMax (MooreThreads/SimuMax, a checkout at PATH; not a dependency, none of its
code is copied: it runs in its own interpreter, ``--python``, and we read its printed figures) on the
layouts both can express: a 4-layer DeepSeek-V3 proxy (dense_layers 1, no MTP, as SimuMax's B200
release rows) on one 8-GPU B200 node, EP x PP x DP with 1F1B, ZeRO-1, recompute off or full, BF16,
sequence 4096, micro-batch 1. SimuMax uses its shipped ``deepseekv3.json`` and measured B200 system file
``b200_bf16_ceperm.json``; ours uses our shipped B200 file, whose per-shape efficiencies are that file's
measurements (its ``sources`` say which), so the remaining gap is the models'. Where SimuMax's release
table (``docs/b200/b200_release_v1.2_summary.md``) has a real Megatron measurement of the case, it is
printed beside both (``benchmarks/planner_runs`` holds those rows for the leave-one-out test).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from accel.cli import BAD_INPUT, ArgumentParser, check_output_file
from planner import Request, evaluate, load_system
from planner.search import Layout
from planner.system import System
from recipes.plan import base_config

CASES = [  # (ep, pp, dp, micro-batches, recompute)
    (8, 1, 8, 4, "none"), (4, 2, 4, 4, "none"), (8, 1, 8, 8, "none"), (4, 2, 4, 8, "none"),
    (8, 1, 8, 32, "none"), (4, 2, 4, 32, "none"), (4, 2, 4, 8, "block"),
]

_DRIVER = r"""
import json, sys
root = sys.argv[1]
sys.path.insert(0, root)
from simumax.core.config import ModelConfig, StrategyConfig, SystemConfig
from simumax.core.perf_llm import PerfLLM
out = []
for ep, pp, dp, mbc, rc in json.loads(sys.argv[2]):
    st = json.load(open(f"{root}/configs/strategy/ep4_pp2_dp4_mbs1.json"))
    st.update(world_size=8, tp_size=1, pp_size=pp, ep_size=ep, micro_batch_num=mbc, micro_batch_size=1,
              seq_len=4096, zero_state=1, enable_recompute=rc != "none")
    if rc != "none":
        st.update(recompute_granularity="full_block", recompute_layer_num=4 // pp)
    model = ModelConfig.init_from_config_file(f"{root}/configs/models/deepseekv3.json")
    model.layer_num, model.dense_layers = 4, 1
    system = SystemConfig.init_from_config_file(f"{root}/configs/system/b200_bf16_ceperm.json")
    perf = PerfLLM()
    perf.configure(strategy_config=StrategyConfig.init_from_dict(st), model_config=model, system_config=system)
    perf.run_estimate()
    cost, mem = perf.analysis_cost(), perf.analysis_mem()
    peak = mem.data.get("peak_mem") or {s: v["peak_mem"] for s, v in mem.data.items()}
    out.append({"step_ms": str(cost.data["duration_time_per_iter"]), "mfu": str(cost.data["mfu"]),
                "peak_mem": str(peak)})
print("SIMUMAX_JSON " + json.dumps(out))
"""


def run_simumax(path: Path, python: str) -> list[dict]:
    proc = subprocess.run([python, "-c", _DRIVER, str(path), json.dumps(CASES)], capture_output=True, text=True,
                          cwd=path, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SIMUMAX_JSON ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"SimuMax at {path} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = json.loads(line.split(" ", 1)[1])
    for r in rows:  # SimuMax prints figures with units ("616.04 ms", "1.1 s", "0.41")
        value, *unit = r["step_ms"].split()
        r["step_ms"] = float(value) * (1000.0 if unit == ["s"] else 1.0)
        r["mfu"] = float(r["mfu"])
    return rows


def published_real(path: Path) -> dict[tuple, float]:
    """Real Megatron step times (ms) of SimuMax's B200 release table, by (ep, pp, dp, micro-batches)."""
    table = path / "docs" / "b200" / "b200_release_v1.2_summary.md"
    out = {}
    if table.is_file():
        for m in re.finditer(r"\| deepseekv3_l4_tp1_ep(\d+)_pp(\d+)_dp(\d+)_mbc(\d+)_cef \| - \| ([\d.]+) \|",
                             table.read_text()):
            out[tuple(int(x) for x in m.groups()[:4])] = float(m.group(5))
    return out


def ours(system: System, ep: int, pp: int, dp: int, mbc: int, rc: str) -> dict:
    base = base_config("deepseek_v3_671b", ["model.overrides.n_layers=4", "model.overrides.n_dense_layers=1",
                                            "model.overrides.n_mtp_layers=0"])
    req = Request(base, system, 8, 4096, dp * mbc)
    lay = Layout(pp, dp, ep, "1f1b" if pp > 1 else "none", 1, mbc, rc, fp8=False, moments="param")
    ev = evaluate(req, lay)
    return {"step_ms": ev.step_time_s * 1e3 if ev.status == "ok" else None, "mfu": ev.mfu,
            "peak_gib": ev.peak_bytes / 1024**3, "status": ev.status, "reason": ev.reason}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m recipes.compare_simumax", description=__doc__.split("\n")[0])
    ap.add_argument("--simumax", required=True, type=Path, help="a SimuMax checkout")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with SimuMax's requirements (default: this one)")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    ns = ap.parse_args(argv)
    try:
        if not (ns.simumax / "simumax" / "core" / "perf_llm.py").is_file():
            raise ValueError(f"--simumax {str(ns.simumax)!r} is not a SimuMax checkout (no simumax/core/perf_llm.py)")
        if shutil.which(ns.python) is None:
            raise ValueError(f"--python {ns.python!r}: no such executable")
        if ns.json:
            check_output_file(ns.json, "--json")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    sm = run_simumax(ns.simumax, ns.python)
    real = published_real(ns.simumax)
    b200 = load_system("B200")
    rows = []
    for case, s in zip(CASES, sm):
        a = ours(b200, *case)
        rows.append({"case": f"ep{case[0]} pp{case[1]} dp{case[2]} mbc{case[3]} rc={case[4]}",
                     "real_ms": real.get(case[:4]) if case[4] == "none" else None,
                     "simumax_ms": s["step_ms"], "ours_ms": a["step_ms"],
                     "simumax_mfu": s["mfu"], "ours_mfu": a["mfu"],
                     "ours_peak_gib": a["peak_gib"], "simumax_peak": s["peak_mem"]})
    print(f"{'case':<30} {'real ms':>8} {'SimuMax':>8} {'ours':>8} {'SM MFU':>7} {'our MFU':>7} "
          f"{'our GiB':>8}")
    for r in rows:
        def f(x, w=8):
            return f"{x:>{w}.1f}" if x is not None else f"{'-':>{w}}"
        print(f"{r['case']:<30} {f(r['real_ms'])} {f(r['simumax_ms'])} {f(r['ours_ms'])} "
              f"{100 * r['simumax_mfu']:>6.1f}% {100 * r['ours_mfu']:>6.1f}% {r['ours_peak_gib']:>8.1f}")
    print("real = Megatron on B200 as published in SimuMax's release table")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
