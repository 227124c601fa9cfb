"""Every speed target of keras-orbax measured in one run, each figure a ratio beside its target.

    python -m benchmarks speed_report                      # full sizes, about 15 minutes on 2 cores
    python -m benchmarks speed_report --size small         # small sizes, 1 round: a smoke run
    python -m benchmarks speed_report --set only=save,reshard_cols --set rounds=1
    python -m benchmarks render speed_report --write-docs  # the saved run into the log

Each case is one benchmark of the suite (`SPEED_COMPONENTS` in registry.py) measured through the
harness (fresh processes, its floor in the same run, medians), then divided by its reference:

  save          sync `keras_orbax.save` / durable write floor, same process (<= 1.1)
  save_many     5000 variables, the same (<= 1.2), and against Keras's `save_weights` (no target)
  many_restore  restore of 5000 variables / reading the step's files, 8 threads (<= 1.2), and /
                Keras's `load_weights(.weights.h5)` (< 1)
  reshard_*     restore onto another layout / onto the saved one, every byte read (<= 1.5), and /
                onto the saved one with large shards mapped (no target), per saved layout
  cold          cold restore / cold read of the same files (<= 1.2), and / that read plus first
                touch of as much fresh memory (no target)
  callback      time `fit` is blocked per save, async / sync, mean and max (<= 0.05 each)
"""

from __future__ import annotations

import os

from benchmarks import harness, render
from benchmarks.registry import BY_NAME, SPEED_COMPONENTS

GREEN, RED, GRAY, BLUE = "#4c9a5a", "#c0504d", "#8c8c8c", "#4f81bd"
COLORS = {True: GREEN, False: RED, None: BLUE}  # target met, missed, none


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
        ko = s["ko"]
        label = f"save, {int(ko['variables'])} variables" if name == "save_many" else "save"
        target = 1.1 if name == "save" else 1.2  # issue 38: the sync save at 1.1 x its floor
        out = [item(name, label, ko["seconds"], ko["floor_s"], target, names=("save", "write floor"),
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


def run_case(case: str, params: dict, work: str) -> dict:
    """One component: its benchmark through the harness (`rounds`: its rounds, default its own)."""
    bench_name, override = SPEED_COMPONENTS[case]
    bench, size = BY_NAME[bench_name], params["size"]
    harness.evict(work)  # the memory earlier components' files held, free again
    command = " ".join(
        ["python -m benchmarks", bench_name, *(f"--set {k}={v}" for k, v in override.items())]
    )
    out: dict = {"command": command, "load_before": os.getloadavg()}
    try:
        where, sized = os.path.join(work, case), {**bench.sizes[size], **override}
        result = harness.measure(bench, size, params.get("rounds"), where, params=sized)
        out.update(seconds=result["wall_s"], items=items(case, result), raw=result)
    except (RuntimeError, KeyError, ZeroDivisionError) as e:
        print(f"[{case}] FAILED: {e}", flush=True)
        out.update(seconds=0.0, error=str(e))
    return dict(out, load_after=os.getloadavg())


def all_items(result: dict) -> list[dict]:
    return [i for r in result["rounds"] for c in r.values() for i in c.get("items", [])]


def target_text(i: dict) -> str:
    return "-" if i["target"] is None else f"{'≤' if i['op'] == '<=' else '<'} {i['target']:g}"


def render_report(result: dict, out_dir: str) -> str:
    """The ratio table, the components' table and two plots (ratio / target, seconds)."""
    rows = all_items(result)
    met = {True: "yes", False: "**no**", None: "-"}
    lines = [
        "## Speed report: every target in one run",
        "",
        "| figure | ours s | reference | reference s | ratio | target | met | n |",
        "|---|---:|---|---:|---:|---:|:-:|---:|",
        *(
            f"| {i['label']} | {i['ours_s']:.3f} | {i['ref_name']} | {i['ref_s']:.3f} | {i['ratio']:.2f} x "
            f"| {target_text(i)} | {met[i['met']]} | {i['n'] or '-'} |"
            for i in rows
        ),
        "",
        "Seconds are medians over `n` fresh processes (callback: over the `n` saves of one `fit`). "
        "The save ratios are the median of save / floor measured in the same process, so they "
        "can differ from the ratio of the medians. The callback's figures divide the mean and the "
        "longest time `fit` was blocked per save by the async callback (the first save included) by "
        "the mean blocked time of a sync save of the same state. The 5000-variable save has the "
        "plain save's target.",
        "",
        "| component | command | wall s | load before -> after | result |",
        "|---|---|---:|---|---|",
    ]
    for name, c in (kv for r in result["rounds"] for kv in r.items()):
        ok = "ok" if "error" not in c else "**failed**: " + c["error"].strip().splitlines()[-1]
        loads = f"{render.loads(c['load_before'])} -> {render.loads(c['load_after'])}"
        ok = ok.replace("|", "/")[:170]  # a table cell
        lines.append(f"| {name} | `{c['command']}` | {c['seconds']:.0f} | {loads} | {ok} |")
    lines += ["", render.provenance(result)]
    smoke = " (smoke run: not a measurement)" if result["size"] == "small" else ""
    heading = f"{result['date']}, {result['machine']['cpus']} CPU cores{smoke}"
    targeted = [i for i in rows if i["target"] is not None]
    ratios = [
        [
            (
                i["ratio"] / i["target"],
                COLORS[i["met"]],
                f"{i['ratio']:.2f} x (target {target_text(i)})",
            )
        ]
        for i in targeted
    ]
    times = [
        [
            (i["ours_s"], COLORS[i["met"]], f"{i['names'][0]} {i['ours_s']:.2f} s"),
            (i["ref_s"], GRAY, f"{i['names'][1]} {i['ref_s']:.2f} s"),
        ]
        for i in rows
    ]
    plots = [
        ("speed_ratios.png", "Each figure divided by its target", targeted, ratios, False,
         "ratio / target (at or left of the dashed line: target met)"),
        ("speed_times.png", "Seconds, ours against the reference", rows, times, True,
         "seconds (median), log scale; gray: the reference, blue: no target"),
    ]  # fmt: skip
    for png, what, chosen, series, log, xlabel in plots if rows else ():
        title, labels = f"{what}\n{heading}", [i["label"] for i in chosen]
        path, line = os.path.join(out_dir, png), None if log else 1.0
        if render.bars(path, labels, series, title, xlabel, log=log, line=line):
            lines += ["", f"![{what}]({png})"]
    return "\n".join(lines) + "\n"
