"""Markdown tables and plots for restore_benchmark.py's results.json / sizes.json."""

from __future__ import annotations

import json
import os
import shutil

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
GIB = 2**30


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_main(results: dict) -> str:
    meta, spec, m = results["meta"], results["spec"], results["machine"]
    disk = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in meta["artifacts"].items())
    lines = [
        "## Restore: time and peak memory",
        "",
        f"Model: {meta['n_params'] / 1e6:.0f} M float32 parameters ({meta['n_params'] * 4 / GIB:.2f} GiB), "
        f"width {spec['width']}, {spec['layers']} Dense blocks, Adam; {meta['n_state_variables']} variables "
        f"with the optimizer's, {meta['logical_bytes'] / GIB:.2f} GiB of state, "
        f"**{meta['resident_bytes'] / GIB:.2f} GiB resident** on 8 CPU devices (replicas counted). "
        f"On disk: {disk}.",
        f"Machine: {m['cpus']} CPU cores, {m['mem_gib']} GiB RAM, 8 virtual CPU devices; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ".",
        "Medians of fresh processes per case; times as a ratio to `orbax_floor` with the same allocator. "
        f"1-minute load average at the end of the runs: up to {max_load(results):.1f} on {m['cpus']} cores "
        "(threads blocked on reads count in it, the benchmark's own included; above the core count, "
        "times are noisy, memory is not).",
        "`x resident` divides by the bytes the arrays occupy on all devices with replicas counted; "
        "on CPU, devices holding the same shard can share one host buffer, so it can fall below 1.",
        "",
    ]
    for allocator in sorted({r["allocator"] for r in results["summary"]}):
        lines += [
            f"**Allocator: {allocator_label(allocator)}**",
            "",
            *main_table(results, allocator),
            "",
        ]
    notes = {r["case"]: r["note"] for r in results["summary"] if r.get("note")}
    lines += [f"- `{c}`: {n}" for c, n in notes.items()]
    return "\n".join(lines) + "\n"


def max_load(results: dict) -> float:
    return max((r.get("loadavg_1m", 0) for r in results["summary"]), default=0)


def allocator_label(name: str) -> str:
    return {"default": "glibc default", "mmap1M": "`MALLOC_MMAP_THRESHOLD_=1048576`"}.get(
        name, name
    )


def main_table(results: dict, allocator: str) -> list[str]:
    rows = {r["case"]: r for r in results["summary"] if r["allocator"] == allocator}
    out = [
        "| case | restore s | x floor | min s | restore CPU s | end-to-end s | x floor | import RSS GiB "
        "| peak - import GiB | x resident | ok | n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|",
    ]
    for case in results["cases"]:
        r = rows.get(case)
        if r is None:
            continue
        if "error" in r:
            out.append(f"| {case} | failed: {r['error'][-120:]} |" + " |" * 10)
            continue
        out.append(
            f"| {case} | {r['restore_s']:.2f} | {fmt(r.get('restore_x_floor'), '.2f')} "
            f"| {fmt(r.get('restore_s_min'), '.2f')} | {fmt(r.get('restore_cpu_s'), '.2f')} | {r['e2e_s']:.1f} "
            f"| {fmt(r.get('e2e_x_floor'), '.2f')} | {r['rss_import_gib']:.2f} | {r['peak_minus_import_gib']:.2f} "
            f"| {r['peak_x_resident']:.2f} | {'yes' if r['ok'] else '**NO**'} | {r['n']} |"
        )
    return out


def render_sizes(sizes: dict) -> str:
    out = [
        "## Peak memory against model size and number of variables",
        "",
        "| model | variables | resident GiB | case | allocator | restore s | peak - import GiB | x resident | ok |",
        "|---|---:|---:|---|---|---:|---:|---:|:-:|",
    ]
    for r in sizes["rows"]:
        if "error" in r:
            out.append(
                f"| {r['tag']} | {r['n_state_variables']} | | {r['case']} | {r['allocator']} | failed ||||"
            )
            continue
        out.append(
            f"| {r['tag']} | {r['n_state_variables']} | {r['resident_gib']:.2f} | {r['case']} | {r['allocator']} "
            f"| {r['restore_s']:.2f} | {r['peak_minus_import_gib']:.2f} | {r['peak_x_resident']:.2f} "
            f"| {'yes' if r['ok'] else '**NO**'} |"
        )
    return "\n".join(out) + "\n\n`pA_lB`: A GiB of float32 parameters, B Dense blocks.\n"


def plot_main(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allocators = sorted({r["allocator"] for r in results["summary"]})
    ok = [r for r in results["summary"] if "error" not in r]
    cases = [c for c in results["cases"] if any(r["case"] == c for r in ok)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = [
        ("restore_x_floor", "restore time / orbax_floor"),
        ("peak_x_resident", "(peak - import RSS) / resident"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        width = 0.8 / len(allocators)
        for i, alloc in enumerate(allocators):
            vals = {r["case"]: r.get(key) or 0 for r in ok if r["allocator"] == alloc}
            xs = [j + i * width for j in range(len(cases))]
            ax.bar(
                xs, [vals.get(c, 0) for c in cases], width, label=allocator_label(alloc).strip("`")
            )
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(
            [j + width * (len(allocators) - 1) / 2 for j in range(len(cases))],
            cases,
            rotation=30,
            ha="right",
        )
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Restore of {results['meta']['resident_bytes'] / GIB:.2f} GiB resident (model + Adam), 8 CPU devices"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sizes(sizes: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    series: dict[tuple, list] = {}
    for r in sizes["rows"]:
        if "error" not in r:
            series.setdefault((r["case"], r["allocator"], r["layers"]), []).append(r)
    for (case, alloc, layers), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["resident_gib"])
        ax.plot(
            [r["resident_gib"] for r in rs],
            [r["peak_minus_import_gib"] for r in rs],
            "o-" if len(rs) > 1 else "s",
            label=f"{case}, {alloc}, {layers} blocks",
        )
    top = max((r["resident_gib"] for rs in series.values() for r in rs), default=1)
    ax.plot([0, top], [0, top], color="gray", lw=0.8, ls="--", label="1 x resident")
    ax.set_xlabel("resident GiB (model + Adam, replicas counted)")
    ax.set_ylabel("peak RSS - post-import RSS, GiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_outputs(work_dir: str, write_docs: bool) -> None:
    """results.md and PNGs in the work dir from whatever results exist there; docs/ on request."""
    results, sizes = (
        load(os.path.join(work_dir, "results.json")),
        load(os.path.join(work_dir, "sizes.json")),
    )
    parts, pngs = (
        ["# keras-orbax restore benchmark\n", "Produced by `benchmarks/restore_benchmark.py`.\n"],
        [],
    )
    if results:
        parts.append(render_main(results) + "\n![restore](restore_benchmark.png)\n")
        plot_main(results, os.path.join(work_dir, "restore_benchmark.png"))
        pngs.append("restore_benchmark.png")
    if sizes:
        parts.append(render_sizes(sizes) + "\n![sizes](restore_benchmark_sizes.png)\n")
        plot_sizes(sizes, os.path.join(work_dir, "restore_benchmark_sizes.png"))
        pngs.append("restore_benchmark_sizes.png")
    markdown = "\n".join(parts)
    with open(os.path.join(work_dir, "results.md"), "w") as f:
        f.write(markdown)
    if write_docs:
        os.makedirs(DOCS, exist_ok=True)
        with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
            f.write(markdown)
        for png in pngs:
            shutil.copy(os.path.join(work_dir, png), os.path.join(DOCS, png))
