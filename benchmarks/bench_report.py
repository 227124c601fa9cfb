"""The restore benchmark's table and plot (restore_benchmark.render feeds them)."""

from __future__ import annotations

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
