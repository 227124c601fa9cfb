"""Figures, a markdown table and a plot for seed_case.py's runs."""

from __future__ import annotations

import os
import statistics

import numpy as np

GIB = 2**30
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "dev")
PNG = "seed_case.png"
TARGETS = {"time": 1.15, "peak": 1.05}  # issue 27: x the cold read, x the resident bytes


def summarize(report: dict, out_dir: str) -> list[dict]:
    """Per mesh: medians of the cold reads and of keras-orbax's loads, their ratios, and
    keras-hub's outcome; ko's forward output compared with keras-hub's where both ran."""
    rows = []
    for mesh in dict.fromkeys(r["mesh"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["mesh"] == mesh]
        reads = [r["seconds"] for r in runs if r["case"] == "read" and r["outcome"] == "ok"]
        kos = [r for r in runs if r["case"] == "ko"]
        hub = next((r for r in runs if r["case"] == "hub"), None)
        builds = [r["build_s"] for r in runs if r["case"] == "build" and r["outcome"] == "ok"]
        kept = [r["seconds"] for r in runs if r["case"] == "read_kept" and r["outcome"] == "ok"]
        row: dict = {
            "mesh": mesh,
            "read_s": median(reads),
            "read_kept_s": median(kept),
            "read_cpu_s": median(
                [r["cpu_s"] for r in runs if r["case"] == "read" and "cpu_s" in r]
            ),
            "read_kept_cpu_s": median(
                [r["cpu_s"] for r in runs if r["case"] == "read_kept" and "cpu_s" in r]
            ),
            "n": len(kos),
            "build_s": median(builds),
        }
        good = [r for r in kos if r["outcome"] == "ok"]
        failed = [r["outcome"] for r in kos if r["outcome"] != "ok"]
        row["ko_outcome"] = failed[-1] if failed else "ok" if kos else "not run"
        loaded = [r for r in kos if "load_s" in r]  # a forward pass killed after the load counts
        if loaded:
            row["ko_s"] = median([r["load_s"] for r in loaded])
            row["resident_bytes"] = loaded[0]["resident_bytes"]
            row["logical_bytes"] = loaded[0]["logical_bytes"]
            row["rss_import"] = max(r["rss_import"] for r in loaded)
            row["peak"] = max(r["peak_load"] for r in loaded)
            row["peak_x"] = (row["peak"] - row["rss_import"]) / row["resident_bytes"]
            row["ko_cpu_s"] = median([r["load_cpu_s"] for r in loaded if "load_cpu_s" in r])
            if row["read_s"]:
                row["read_x"] = row["ko_s"] / row["read_s"]
            # The issue's floor is the read into kept huge-page memory; the plain cold read where
            # that was not run (`--no-kept-read`).
            row["floor_s"] = row["read_kept_s"] or row["read_s"]
            if row["floor_s"]:
                row["time_x"] = row["ko_s"] / row["floor_s"]
        if good:
            row["peak_end"] = max(r["peak_end"] for r in good)
            row["forward_s"] = median([r["forward_s"] for r in good])
            row["finite"] = all(r["finite"] for r in good)
        if hub is not None:
            row["hub_outcome"] = hub["outcome"]
            row["hub_peak"] = max(hub.get("peak_load") or 0, hub["peak_polled"])
            if hub.get("rss_import") and row.get("resident_bytes"):
                row["hub_peak_x"] = (row["hub_peak"] - hub["rss_import"]) / row["resident_bytes"]
            row["hub_s"] = hub.get("load_s")
            row["hub_rss_import"] = hub.get("rss_import")
            same = _same_output(out_dir, mesh) if hub["outcome"] == "ok" and good else None
            row["hub_equal"] = same
        rows.append(row)
    return rows


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _same_output(out_dir: str, mesh: str) -> bool | None:
    paths = [os.path.join(out_dir, f"{case}_{mesh}.npy") for case in ("ko", "hub")]
    if not all(os.path.exists(p) for p in paths):
        return None
    return bool(np.array_equal(np.load(paths[0]), np.load(paths[1])))


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def met(value, target: float) -> str:
    return "-" if value is None else "yes" if value <= target else "**no**"


def markdown(report: dict) -> str:
    m, rows = report["machine"], report["summary"]
    size = report["preset_bytes"]
    make = report.get("make")
    made = (
        f" Made by `seed_case.py` in {make['seconds']:.0f} s (peak RSS {make['peak_polled'] / GIB:.2f} GiB)."
        if make and make.get("seconds")
        else ""
    )
    logical = next((r["logical_bytes"] for r in rows if r.get("logical_bytes")), None)
    lines = [
        f"Preset: `GemmaBackbone`, `--config {report['config']}`, {size / 1e9:.2f} GB in "
        f"{', '.join(f'`{f}`' for f in report['preset_files'])}; the model "
        f"{fmt(logical, '.2f', GIB)} GiB.{made}",
        f"Run on {m['date']} at commit `{m['commit']}` in {report['minutes']:.1f} minutes. Machine: "
        f"{m['cpus']} CPU cores, {m['mem_gib']} GiB RAM, 8 virtual CPU devices; Python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ". Load average (1/5/15 min) "
        + "/".join(f"{x:.1f}" for x in report["load_before"])
        + " before, "
        + "/".join(f"{x:.1f}" for x in report["load_after"])
        + " after.",
        "",
        "**keras-orbax** `from_preset`:",
        "",
        "| mesh | load s | of it building | floor s | x floor | target | met | peak GiB "
        "| peak - import GiB | resident GiB | x resident | target | met | forward pass | n |",
        "|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|:-:|---|---:|",
    ]
    for r in rows:
        if "ko_s" not in r:
            lines.append(f"| {r['mesh']} | {r['ko_outcome']} |" + " |" * 13)
            continue
        if "forward_s" in r:
            finite = "finite" if r["finite"] else "**not finite**"
            forward = f"{r['forward_s']:.1f} s, {finite}, peak {r['peak_end'] / GIB:.2f} GiB"
        else:
            forward = r["ko_outcome"]
        lines.append(
            f"| {r['mesh']} | {r['ko_s']:.1f} | {fmt(r['build_s'], '.1f')} "
            f"| {fmt(r.get('floor_s'), '.1f')} | {fmt(r.get('time_x'), '.2f')} | {TARGETS['time']} "
            f"| {met(r.get('time_x'), TARGETS['time'])} | {r['peak'] / GIB:.2f} "
            f"| {(r['peak'] - r['rss_import']) / GIB:.2f} | {r['resident_bytes'] / GIB:.2f} "
            f"| {r['peak_x']:.2f} | {TARGETS['peak']} | {met(r['peak_x'], TARGETS['peak'])} "
            f"| {forward} | {r['n']} |"
        )
    if any(r.get("read_kept_s") or r.get("ko_cpu_s") for r in rows):
        lines += [
            "",
            "The same loads against the plain cold read (into reused buffers), and CPU seconds "
            "(user and system, all threads):",
            "",
            "| mesh | load s | cold read s | x that | load CPU s "
            "| cold read CPU s | into kept memory CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "ko_s" in r:
                lines.append(
                    f"| {r['mesh']} | {r['ko_s']:.1f} | {fmt(r.get('read_s'), '.1f')} "
                    f"| {fmt(r.get('read_x'), '.2f')} | {fmt(r.get('ko_cpu_s'), '.1f')} "
                    f"| {fmt(r.get('read_cpu_s'), '.1f')} "
                    f"| {fmt(r.get('read_kept_cpu_s'), '.1f')} |"
                )
    lines += [
        "",
        "**keras-hub's own** `GemmaBackbone.from_preset`, same distribution:",
        "",
        "| mesh | outcome | load s | peak GiB | peak - import GiB | x resident | forward output |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "hub_outcome" not in r:
            continue
        equal = {True: "equal to keras-orbax's", False: "**differs** from keras-orbax's", None: "-"}
        hub_import = r.get("hub_rss_import")
        lines.append(
            f"| {r['mesh']} | {r['hub_outcome']} | {fmt(r.get('hub_s'), '.1f')} "
            f"| {fmt(r.get('hub_peak'), '.2f', GIB)} "
            f"| {fmt(r['hub_peak'] - hub_import if hub_import else None, '.2f', GIB)} "
            f"| {fmt(r.get('hub_peak_x'), '.2f')} | {equal[r.get('hub_equal')]} |"
        )
    for r in report["runs"]:
        if r.get("exit_after_answer"):
            lines.append(
                f"- `{r['case']}` {r['mesh']} exited abnormally after its figures: "
                f"{r['exit_after_answer']}"
            )
    lines += [
        "",
        "`load s`: `from_preset` until every array is ready, page cache dropped first; "
        "`of it building`: the same model built deferred, no weight read (another process); "
        "`cold read s`: every byte of the preset's files read once, 16 MiB at a time by 8 threads, "
        "page cache dropped first "
        "(medians of `n` alternating rounds, fresh processes). `peak`: the process's peak RSS "
        "(`VmHWM`) up to the end of the load (keras-hub: or when it was killed, by this benchmark "
        "before the machine ran out or by the kernel); `- import`: less its RSS once JAX and its 8 "
        "devices were up; `resident`: the bytes of the distinct device buffers (replicas sharing "
        "one host buffer counted once). `forward pass`: a (2, 8) token batch through the backbone, "
        "called eagerly, and the process's peak RSS by its end. `floor` (the issue's): "
        "the same cold read into a new 16 MiB buffer per read, 2 MiB-aligned and advised "
        "`MADV_HUGEPAGE`, all kept to the end, as a load keeps its arrays (every page zeroed by "
        "the kernel when first touched), run between the cold read and the load; the cold read "
        "itself where that was not run.",
    ]
    return "\n".join(lines) + "\n"


def write_docs(report: dict, text: str) -> None:
    """Replaces the section between the `bench:seed_case` markers in the log and
    draws the plot."""
    from benchmarks.render import PAGE, replace_section

    if plot(report, os.path.join(DOCS, PNG)):
        text += f"\n![The seed case: ratios to targets]({PNG})\n"
    with open(PAGE) as f:
        page = replace_section(f.read(), "seed_case", text)
    with open(PAGE, "w") as f:
        f.write(page)


def plot(report: dict, path: str) -> bool:
    """Time and peak ratios per mesh against their targets, keras-hub's peak against the machine's
    memory; False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    rows = [r for r in report["summary"] if "ko_s" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 2.2 + 0.5 * len(rows)))
    labels, values, targets = [], [], []
    for r in rows:
        for what, key in (("time / floor", "time_x"), ("peak / resident", "peak_x")):
            if r.get(key) is not None:
                labels.append(f"{r['mesh']} {what}")
                values.append(r[key])
                targets.append(TARGETS["time" if key == "time_x" else "peak"])
    colors = ["#4c9a5a" if v <= t else "#c0504d" for v, t in zip(values, targets, strict=True)]
    left.barh(range(len(values)), values, color=colors)
    for y, (v, t) in enumerate(zip(values, targets, strict=True)):
        left.plot([t, t], [y - 0.4, y + 0.4], color="#8c8c8c", ls="--")
        left.text(v, y, f" {v:.2f} x (target {t})", va="center", fontsize=8)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    left.set_xlim(0, max([*values, 1.2]) * 1.5)
    left.set_title("keras-orbax from_preset", fontsize=10)
    mem = report["machine"]["mem_gib"]
    names, peaks = [], []
    for r in report["summary"]:
        names += [f"{r['mesh']} keras-orbax", f"{r['mesh']} keras-hub"]
        peaks += [(r.get("peak") or 0) / GIB, (r.get("hub_peak") or 0) / GIB]
    right.barh(range(len(peaks)), peaks, color=["#4f81bd", "#8c8c8c"] * len(report["summary"]))
    right.axvline(mem, color="#c0504d", ls="--", lw=1)
    right.set_yticks(range(len(names)), names)
    right.invert_yaxis()
    right.set_xlabel(f"peak RSS GiB (dashed: the machine's {mem} GiB)")
    right.set_title("Peak memory of the load", fontsize=10)
    fig.suptitle(f"GemmaBackbone --config {report['config']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
