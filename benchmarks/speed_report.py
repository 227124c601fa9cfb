"""Every speed target of keras-orbax measured in one run, each figure a ratio beside its target.

    python -m benchmarks speed_report                  # full sizes, about 15 minutes on 2 cores
    python -m benchmarks speed_report -- --quick       # small sizes, 1 round: a smoke run
    python -m benchmarks speed_report -- --write-docs  # also docs/benchmarks.md's section + PNGs
    python -m benchmarks speed_report -- --only save,reshard_cols
    python -m benchmarks speed_report -- --report-only [--write-docs]   # re-render the last JSON

Runs the suite's benchmarks one after another through the harness (fresh processes, floors in the
same run, medians) and divides each figure by its reference:

  save          sync `keras_orbax.save` / durable write floor, same process (<= 1.2)
  save_many     5000 variables, the same (<= 1.2), and against Keras's `save_weights` (no target)
  many_restore  restore of 5000 variables / reading the step's files, 8 threads (<= 1.2), and /
                Keras's `load_weights(.weights.h5)` (< 1)
  reshard_*     restore onto another layout / onto the saved one, every byte read (<= 1.5), and /
                onto the saved one with large shards mapped (no target), per saved layout
  cold          cold restore / cold read of the same files (<= 1.2), and / that read plus first
                touch of as much fresh memory (no target)
  callback      time `fit` is blocked per save, async / sync, mean and max (<= 0.05 each)

Writes <work>/speed_report.json, speed_report.md and the PNGs (speed_render.py); --write-docs also
replaces docs/benchmarks.md's speed-report section and copies the PNGs to docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime

from benchmarks import harness, speed_render
from benchmarks.registry import BY_NAME

LAYOUTS = ("cols", "rows", "2d", "2d_rows", "h5")
# component -> (benchmark, parameters over its sizes)
COMPONENTS = {
    "save": ("save", {}),
    "save_many": ("save_many", {}),
    "many_restore": ("many_restore", {}),
    **{f"reshard_{layout}": ("reshard", {"layout": layout}) for layout in LAYOUTS},
    "cold": ("cold", {}),
    "callback": ("callback", {}),
}


def item(key, label, ours, ref, target, op="<=", *, names, ref_name, n=None, ratio=None) -> dict:
    """One figure: `ours` / `ref` seconds (or `ratio`) beside its target (None: no target)."""
    ratio = ours / ref if ratio is None else ratio
    met = None if target is None else (ratio <= target if op == "<=" else ratio < target)
    return {
        "key": key, "label": label, "ratio": ratio, "target": target, "op": op, "met": met,
        "ours_s": ours, "ref_s": ref, "names": names, "ref_name": ref_name, "n": n,
    }  # fmt: skip


def items(name: str, result: dict) -> list[dict]:
    """The figures of one component from its harness result."""
    s, params = result["summary"], result["params"]
    n = result["repeats"]
    if name.startswith("save"):
        ko, label = (
            s["ko"],
            f"save, {int(s['ko']['variables'])} variables" if name == "save_many" else "save",
        )
        out = [item(name, label, ko["seconds"], ko["floor_s"], 1.2, names=("save", "write floor"),
                    ref_name="durable write floor", n=n, ratio=ko["x_floor"])]  # fmt: skip
        if "keras_h5" in s:
            out.append(item(f"{name}_h5", f"{label} vs Keras h5", ko["seconds"], s["keras_h5"]["seconds"],
                            None, names=("save", "Keras save_weights"),
                            ref_name="Keras `save_weights(.weights.h5)`", n=n))  # fmt: skip
        return out
    if name == "many_restore":
        label = f"restore, {int(s['ko']['variables'])} variables"
        return [
            item(name, label, s["ko"]["seconds"], s["read"]["seconds"], 1.2, names=("restore", "file read"),
                 ref_name="reading every file of the step, 8 threads", n=n),
            item(f"{name}_h5", f"{label} vs Keras h5", s["ko"]["seconds"], s["keras_h5"]["seconds"], 1.0,
                 "<", names=("restore", "Keras load_weights"), ref_name="Keras `load_weights(.weights.h5)`", n=n),
        ]  # fmt: skip
    if name.startswith("reshard"):
        label = f"reshard {params['layout']}"
        out = [item("reshard", label, s["other"]["seconds"], s["copied"]["seconds"], 1.5,
                    names=("other layout", "same layout, read"), n=n,
                    ref_name="restore onto the saved layout, every byte read into fresh memory")]  # fmt: skip
        if params["layout"] != "h5":  # h5 files are never mapped
            out.append(item("reshard_mapped", f"{label} vs the saved layout mapped", s["other"]["seconds"],
                            s["same"]["seconds"], None, names=("other layout", "same layout, mapped"),
                            ref_name="restore onto the saved layout, large shards mapped (opted in)", n=n))  # fmt: skip
        return out
    if name == "cold":
        cold, read = s["ko_cold"]["seconds"], s["read_cold"]["seconds"]
        return [
            item(name, "cold restore", cold, read, 1.2, names=("cold restore", "cold read"),
                 ref_name="cold read of the same files, 8 threads", n=n),
            item("cold_touch", "cold restore vs read + fresh memory", cold, read + s["touch"]["seconds"],
                 None, names=("cold restore", "cold read + first touch"),
                 ref_name="cold read of the same files + first touch of as much fresh memory", n=n),
        ]  # fmt: skip
    sync, ko, saves = s["sync"]["seconds"], s["async"], int(result["params"]["epochs"])
    ref = "blocked time of a sync save (`save_on_background=False`), mean"
    return [
        item("callback_mean", "callback blocked, mean", ko["seconds"], sync, 0.05,
             names=("async, mean", "sync save"), ref_name=ref, n=saves),
        item("callback_max", "callback blocked, max", ko["max_s"], sync, 0.05,
             names=("async, max", "sync save"), ref_name=ref, n=saves),
        item("callback_keras", "Keras OrbaxCheckpoint blocked, mean", s["keras"]["seconds"], sync, None,
             names=("Keras, mean", "sync save"), ref_name=ref, n=saves),
    ]  # fmt: skip


def run_component(name: str, args) -> dict:
    bench_name, override = COMPONENTS[name]
    bench = BY_NAME[bench_name]
    size = "small" if args.quick else "full"
    params = {**bench.sizes[size], **override}
    work = os.path.join(args.work, name)
    harness.evict(args.work)  # the memory earlier components' files held, free again
    command = ["python -m benchmarks", bench_name, *(f"--set {k}={v}" for k, v in override.items())]
    entry: dict = {"command": command, "load_before": os.getloadavg()}
    start = time.perf_counter()
    try:
        result = harness.measure(bench, size, args.repeats, work, params=params)
        entry.update(raw=result, items=items(name, result))
    except (RuntimeError, KeyError, ZeroDivisionError) as e:
        print(f"[{name}] FAILED: {e}", flush=True)
        entry["error"] = str(e)
    return dict(entry, wall_s=time.perf_counter() - start, load_after=os.getloadavg())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 1 round")
    p.add_argument("--repeats", type=int, default=None, help="override every component's rounds")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(COMPONENTS))
    p.add_argument("--work", default=os.path.join(harness.WORK, "speed"))
    p.add_argument("--json", default=os.path.join(harness.WORK, "speed_report.json"))
    p.add_argument("--write-docs", action="store_true", help="docs/benchmarks.md section + PNGs")
    p.add_argument("--report-only", action="store_true", help="re-render --json without running")
    args = p.parse_args(argv)
    if set(args.only) - set(COMPONENTS):
        p.error(
            f"unknown components {sorted(set(args.only) - set(COMPONENTS))}; choose from {', '.join(COMPONENTS)}"
        )
    args.work = os.path.abspath(args.work)
    if args.repeats is None and args.quick:
        args.repeats = 1
    if args.report_only:
        with open(args.json) as f:
            report = json.load(f)
    else:
        os.makedirs(args.work, exist_ok=True)
        started, load_before = time.perf_counter(), os.getloadavg()
        report = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": args.quick,
            "machine": harness.machine(),
            "load_before": load_before,
            "components": {name: run_component(name, args) for name in args.only},
        }
        report.update(load_after=os.getloadavg(), wall_s=time.perf_counter() - started)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    out_dir = os.path.dirname(os.path.abspath(args.json))
    print("\n" + speed_render.write_outputs(report, out_dir, args.write_docs))


if __name__ == "__main__":
    main()
