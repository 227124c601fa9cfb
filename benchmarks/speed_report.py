"""Every speed target of keras-orbax measured in one run, each figure a ratio beside its target.

    python benchmarks/speed_report.py                 # full sizes, about 15 minutes on 2 cores
    python benchmarks/speed_report.py --quick         # smoke sizes, 1 repeat: about 3 minutes
    python benchmarks/speed_report.py --write-docs    # also docs/benchmarks.md's section + PNGs
    python benchmarks/speed_report.py --only save,reshard       # some components only
    python benchmarks/speed_report.py --report-only [--write-docs]   # re-render the last JSON

Runs the other benchmark scripts one after another, each in its own processes, and reads the JSON
each writes (logs: <work>/logs/<component>.log):

  save          save_benchmark.py --cases ko: sync `keras_orbax.save` / durable write floor (<= 1.2)
  save_many     save_benchmark.py --many --cases ko keras_h5: 5000 variables, the same ratio (<= 1.2),
                and against Keras's `save_weights` (no target)
  many_restore  many_restore_benchmark.py: restore of 5000 variables / reading the step's files with 8
                threads (<= 1.2), and / Keras's `load_weights(.weights.h5)` (< 1)
  reshard       reshard_benchmark.py: restore onto another layout / onto the saved one with every
                byte read, as by default (<= 1.5), and / onto the saved one with large shards
                mapped (`KERAS_ORBAX_MAP_SHARDS=1`)
  cold          cold_benchmark.py: cold-cache restore / cold read of the same files (<= 1.2), and /
                that read plus first touch of as much fresh memory (no target)
  callback      callback_benchmark.py: time `fit` is blocked per save by the async callback / a sync
                save's, mean and max over the saves, the first included (<= 0.05 each)

Writes <work>/speed_report.json (default benchmarks/_work/speed_report.json), <work>/speed_report.md,
<work>/speed_ratios.png and <work>/speed_times.png; with --write-docs the markdown also replaces the
section between the speed-report markers of docs/benchmarks.md and the PNGs go to docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COMPONENTS = ("save", "save_many", "many_restore", "reshard", "cold", "callback")

# Per component: (script, size flags at full size, size flags with --quick, repeats at full size).
# Full sizes are chosen so that the whole report takes 10-20 minutes on 2 shared cores.
SIZES = {
    "save": ("save_benchmark.py", ["--layers", "8"], ["--layers", "2", "--width", "1024"], 3),
    "save_many": ("save_benchmark.py", ["--layers", "2500"], ["--layers", "250"], 3),
    "many_restore": ("many_restore_benchmark.py", ["--layers", "2500"], ["--layers", "250"], 3),
    "reshard": (
        "reshard_benchmark.py",
        ["--rows", "65536", "--cols", "1024"],
        ["--rows", "8192", "--cols", "256"],
        3,
    ),
    "cold": ("cold_benchmark.py", ["--params-gib", "0.5"], ["--params-gib", "0.02"], 5),
    "callback": (
        "callback_benchmark.py",
        ["--mib", "256", "--epochs", "4", "--steps", "8"],
        ["--mib", "16", "--epochs", "2", "--steps", "2"],
        None,
    ),
}


def command(name: str, args) -> tuple[list[str], str]:
    """The command line of one component and the JSON file it leaves its figures in."""
    script, full, quick, full_repeats = SIZES[name]
    work = os.path.join(args.work, name)
    out = os.path.join(args.work, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, script), *(quick if args.quick else full)]
    if full_repeats is not None:
        repeats = args.repeats or (1 if args.quick else full_repeats)
        cmd += ["--repeats", str(repeats)]
    if name == "save":
        return [*cmd, "--cases", "ko", "--work", work], os.path.join(work, "save_results.json")
    if name == "save_many":
        cmd += ["--many", "--cases", "ko", "keras_h5", "--work", work]
        return cmd, os.path.join(work, "save_results.json")
    if name == "cold":
        shutil.rmtree(work, ignore_errors=True)  # a fresh checkpoint of this code and size
    if name == "callback":
        return [*cmd, "--json", out], out
    return [*cmd, "--work", work, "--json", out], out


def forget_earlier_files(work: str) -> None:
    """Writes back and evicts from the page cache every file the earlier components left under
    `work`, so each component starts with the memory they held free (the cold restore, right after
    the reshard benchmark's gigabytes, otherwise measured 2.5-3 x where it measures 1.0 x alone)."""
    import cold_benchmark  # this directory is on sys.path (see the end of this file)

    os.sync()
    cold_benchmark.evict(work)


def run_component(name: str, args) -> dict:
    forget_earlier_files(args.work)
    cmd, out = command(name, args)
    if os.path.exists(out):
        os.remove(out)
    log = os.path.join(args.work, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print(
        f"[{name}] {' '.join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd)}"
    )
    load_before, start = os.getloadavg(), time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    entry = {
        "command": cmd[1:],
        "wall_s": time.perf_counter() - start,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "log": log,
    }
    if done.returncode or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-1500:]
        print(f"[{name}] FAILED (exit {done.returncode}); see {log}", flush=True)
        return dict(entry, error=f"exit {done.returncode}: {tail}")
    with open(out) as f:
        entry["raw"] = json.load(f)
    try:
        entry["items"] = EXTRACT[name](entry["raw"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # the script's JSON changed
        print(f"[{name}] its JSON lacks a figure: {e!r}; see {out}", flush=True)
        return dict(entry, error=f"reading {out}: {e!r}")
    print(f"[{name}] {entry['wall_s']:.0f} s: " + "; ".join(brief(i) for i in entry["items"]))
    return entry


def brief(item: dict) -> str:
    target = "no target" if item["target"] is None else f"target {item['op']} {item['target']:g}"
    return f"{item['label']} {item['ratio']:.2f} x ({target})"


def item(key, label, ours, ref, target, op="<=", *, names, ref_name, n=None) -> dict:
    """One figure: `ours` / `ref` seconds beside its target (None: shown for comparison only).
    `names` labels the two bars of the times plot; `ref_name` says what the reference is."""
    ratio = ours / ref
    met = None if target is None else (ratio <= target if op == "<=" else ratio < target)
    return {
        "key": key,
        "label": label,
        "ratio": ratio,
        "target": target,
        "op": op,
        "met": met,
        "ours_s": ours,
        "ref_s": ref,
        "names": names,
        "ref_name": ref_name,
        "n": n,
    }


def save_items(runs: list[dict], many: bool) -> list[dict]:
    ko = [r for r in runs if r["case"] == "ko"]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    label = f"save, {ko[0]['variables']} variables" if many else "save"
    key = "save_many" if many else "save"
    floor = item(
        key,
        label,
        med(ko, "save_s"),
        med(ko, "floor_s"),
        1.2,
        names=("save", "write floor"),
        ref_name="durable write floor",
        n=len(ko),
    )
    floor["ratio"] = statistics.median(r["save_s"] / r["floor_s"] for r in ko)  # same-process pairs
    floor["met"] = floor["ratio"] <= 1.2
    h5 = [r for r in runs if r["case"] == "keras_h5"]
    if not h5:
        return [floor]
    keras = item(
        f"{key}_h5",
        f"{label} vs Keras h5",
        med(ko, "save_s"),
        med(h5, "save_s"),
        None,
        names=("save", "Keras save_weights"),
        ref_name="Keras `save_weights(.weights.h5)`",
        n=len(h5),
    )
    return [floor, keras]


def many_restore_items(raw: dict) -> list[dict]:
    m, n, label = raw["median_s"], raw["repeats"], f"restore, {raw['variables']} variables"
    if not raw["ok"]:
        label += " (WRONG VALUES restored)"
    return [
        item(
            "many_restore",
            label,
            m["ko"],
            m["read"],
            1.2,
            names=("restore", "file read"),
            ref_name="reading every file of the step, 8 threads",
            n=n,
        ),
        item(
            "many_restore_h5",
            f"{label} vs Keras h5",
            m["ko"],
            m["keras_h5"],
            1.0,
            "<",
            names=("restore", "Keras load_weights"),
            ref_name="Keras `load_weights(.weights.h5)`",
            n=n,
        ),
    ]


def reshard_items(raw: dict) -> list[dict]:
    """Per case, the restore onto another layout against the saved layout's restore doing the same
    work, reading every byte into fresh memory, as it runs by default (target); and against the
    saved layout's restore opted in to mapping its large shards from their files instead of copying
    them (`KERAS_ORBAX_MAP_SHARDS=1`; no target: no other layout can be mapped, since its regions
    are assembled from parts of several files)."""
    out = []
    for case, m in raw["median_s"].items():
        mapped = "copied" in raw["seconds"].get(case, {})  # h5 and older results: no mapping
        out.append(
            item(
                "reshard",
                f"reshard {case}",
                m["other"],
                m["copied"] if mapped else m["same"],
                1.5,
                names=("other layout", "same layout, read" if mapped else "same layout"),
                ref_name="restore onto the saved layout, every byte read into fresh memory"
                if mapped
                else "restore onto the saved layout",
                n=raw["repeats"],
            )
        )
        if mapped:
            out.append(
                item(
                    "reshard_mapped",
                    f"reshard {case} vs the saved layout mapped",
                    m["other"],
                    m["same"],
                    None,
                    names=("other layout", "same layout, mapped"),
                    ref_name="restore onto the saved layout, large shards mapped (opted in)",
                    n=raw["repeats"],
                )
            )
    return out


def cold_items(raw: dict) -> list[dict]:
    m = raw["median_s"]
    out = [
        item(
            "cold",
            "cold restore",
            m["ko_cold"],
            m["read_cold"],
            1.2,
            names=("cold restore", "cold read"),
            ref_name="cold read of the same files, 8 threads",
            n=raw["repeats"],
        ),
    ]
    if "touch" in m:  # results of an older cold_benchmark.py have no first-touch case
        out.append(
            item(
                "cold_touch",
                "cold restore vs read + fresh memory",
                m["ko_cold"],
                m["read_cold"] + m["touch"],
                None,
                names=("cold restore", "cold read + first touch"),
                ref_name="cold read of the same files + first touch of as much fresh memory",
                n=raw["repeats"],
            )
        )
    return out


def callback_items(raw: dict) -> list[dict]:
    variants, saves = raw["variants"], raw["epochs"]
    sync = variants["keras_orbax sync"]["blocked_per_save_s"]
    ko = variants["keras_orbax async"]
    ref = "blocked time of a sync save (`save_on_background=False`), mean"
    out = [
        item(
            "callback_mean",
            "callback blocked, mean",
            ko["blocked_per_save_s"],
            sync,
            0.05,
            names=("async, mean", "sync save"),
            ref_name=ref,
            n=saves,
        ),
        item(
            "callback_max",
            "callback blocked, max",
            ko["blocked_per_save_max_s"],
            sync,
            0.05,
            names=("async, max", "sync save"),
            ref_name=ref,
            n=saves,
        ),
    ]
    keras = variants.get("keras OrbaxCheckpoint")
    if keras:
        out.append(
            item(
                "callback_keras",
                "Keras OrbaxCheckpoint blocked, mean",
                keras["blocked_per_save_s"],
                sync,
                None,
                names=("Keras, mean", "sync save"),
                ref_name=ref,
                n=saves,
            )
        )
    return out


EXTRACT = {
    "save": lambda raw: save_items(raw, many=False),
    "save_many": lambda raw: save_items(raw, many=True),
    "many_restore": many_restore_items,
    "reshard": reshard_items,
    "cold": cold_items,
    "callback": callback_items,
}


def machine() -> dict:
    from importlib.metadata import version

    pkgs = ("keras", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")
    commit = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in pkgs},
        "commit": commit,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke sizes, 1 repeat")
    p.add_argument("--repeats", type=int, default=None, help="override every component's repeats")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(COMPONENTS))
    p.add_argument("--work", default=os.path.join(HERE, "_work", "speed"))
    p.add_argument("--json", default=os.path.join(HERE, "_work", "speed_report.json"))
    p.add_argument("--write-docs", action="store_true", help="docs/benchmarks.md section + PNGs")
    p.add_argument("--report-only", action="store_true", help="re-render --json without running")
    args = p.parse_args(argv)
    unknown = set(args.only) - set(COMPONENTS)
    if unknown:
        p.error(f"unknown components {sorted(unknown)}; choose from {', '.join(COMPONENTS)}")
    args.work = os.path.abspath(args.work)
    import speed_render

    if args.report_only:
        with open(args.json) as f:
            report = json.load(f)
    else:
        os.makedirs(args.work, exist_ok=True)
        started, load_before = time.perf_counter(), os.getloadavg()
        report = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": args.quick,
            "machine": machine(),
            "load_before": load_before,
            "components": {name: run_component(name, args) for name in args.only},
        }
        report.update(load_after=os.getloadavg(), wall_s=time.perf_counter() - started)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    markdown = speed_render.write_outputs(
        report, os.path.dirname(os.path.abspath(args.json)), args.write_docs
    )
    print("\n" + markdown)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
