"""The one renderer: the benchmark log's tables and plots from saved results (JSON).

`python -m benchmarks render NAME [--write-docs]` reads `benchmarks/_work/results/NAME.json` (what
`python -m benchmarks NAME` saved), writes `NAME.md` and the plots beside it and, with
`--write-docs`, replaces the part of docs/dev/benchmarks-log.md between `<!-- bench:NAME:begin -->`
and `<!-- bench:NAME:end -->` and copies the plots beside it (a page without the markers gets the
section appended). docs/benchmarks.md, the users' summary, is written by hand from the log.
"""

from __future__ import annotations

import os
import shutil

from benchmarks.harness import REPO, Benchmark, call

# The engineering log, outside the site's navigation; its plots beside it.
DOCS = os.path.join(REPO, "docs", "dev")
PAGE = os.path.join(DOCS, "benchmarks-log.md")


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def loads(triple) -> str:
    return "/".join(f"{x:.1f}" for x in triple)


def provenance(result: dict) -> str:
    """Where, when and on what a result was measured: one sentence for under its table."""
    m = result["machine"]
    smoke = (
        "**Smoke run (`--size small`): not a measurement.** " if result["size"] == "small" else ""
    )
    params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
    return (
        f"{smoke}`python -m benchmarks {result['benchmark']}` ({params}) on {result['date']} at "
        f"commit `{m['commit']}`: {result['repeats']} rounds of fresh processes, cases alternating, "
        f"medians. Machine: {m['cpus']} CPU cores, {m['mem_gib']} GiB RAM; load average "
        f"(1/5/15 min) {loads(result['load_before'])} before, {loads(result['load_after'])} after."
    )


def table(bench: Benchmark, result: dict) -> list[str]:
    """One row per case: median and min seconds, x floor (median of same-round pairs), extras."""
    extra = [c for c in bench.columns if any(c[0] in r for r in result["summary"].values())]
    head = "| case | what it measures | median s | min s | x floor |"
    head += "".join(f" {h} |" for _, h, _ in extra) + " load 1 min | n |"
    out = [head, "|---|---|" + "---:|" * (4 + len(extra)) + "---:|"]
    for case, row in result["summary"].items():
        floor = "floor" if case == bench.floor else fmt(row.get("x_floor"), ".2f")
        cells = "".join(f" {fmt(row.get(k), f)} |" for k, _, f in extra)
        out.append(
            f"| `{case}` | {bench.cases.get(case, '')} | {row['seconds']:.3f} "
            f"| {row['seconds_min']:.3f} | {floor} |{cells} {fmt(row.get('loadavg_1m'), '.1f')} "
            f"| {row['n']} |"
        )
    return out


def markdown(bench: Benchmark, result: dict, out_dir: str) -> str:
    if bench.render:
        return call(bench.render, result, out_dir)
    return "\n".join([*table(bench, result), "", provenance(result)]) + "\n"


def replace_section(text: str, name: str, section: str) -> str:
    """`text` with the part between NAME's markers replaced (appended when they are absent)."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write(bench: Benchmark, result: dict, out_dir: str, write_docs: bool) -> str:
    """NAME.md (and any plots) in `out_dir`; the log's section and PNGs on request."""
    os.makedirs(out_dir, exist_ok=True)
    before = set(os.listdir(out_dir))
    text = markdown(bench, result, out_dir)
    with open(os.path.join(out_dir, f"{bench.name}.md"), "w") as f:
        f.write(text)
    if write_docs:
        with open(PAGE) as f:
            page = f.read()
        with open(PAGE, "w") as f:
            f.write(replace_section(page, bench.name, text))
        for png in sorted(set(os.listdir(out_dir)) - before | plots_named(text)):
            if png.endswith(".png") and os.path.exists(os.path.join(out_dir, png)):
                shutil.copy(os.path.join(out_dir, png), os.path.join(DOCS, png))
    return text


def plots_named(text: str) -> set[str]:
    """The PNG files a section's markdown shows (`![...](name.png)`)."""
    return {part.split(")")[0] for part in text.split("](")[1:] if ".png" in part.split(")")[0]}


def bars(
    path: str, labels: list[str], series: list, title: str, xlabel: str, *, log=False, line=None
) -> bool:
    """A horizontal bar plot at `path`: one group per label, `series[k]` its bars, each
    (value, color, text). False (and no plot) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print('No plots: they need matplotlib (pip install -e ".[bench]").', flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = max((len(group) for group in series), default=1)
    fig, ax = plt.subplots(figsize=(9, (0.3 + 0.25 * per) * len(labels) + 1.8))
    height = 0.8 / per
    for y, group in enumerate(series):
        for j, (value, color, text) in enumerate(group):
            at = y + (j - (per - 1) / 2) * height
            ax.barh(at, value, height, color=color)
            ax.text(value, at, f" {text}", va="center", fontsize=7 if per > 1 else 8)
    if line is not None:
        ax.axvline(line, color="#8c8c8c", lw=1, ls="--")
    longest = max((v for group in series for v, _, _ in group), default=1.0)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(right=longest * 20)
    else:
        ax.set_xlim(0, max(longest, line or 0) * 1.6)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
