"""The one way a benchmark is measured: each run in a fresh process, the floor in the same run,
cases alternating, medians, and the machine's load and core count recorded with every figure.

A benchmark (a `Benchmark` in `benchmarks/registry.py`) names a function `module:function` that
runs one case in a fresh process and returns its figures (at least `seconds`):

```python
def run_case(case: str, params: dict, work: str) -> dict:
    ...
    return {"seconds": 0.42, "cpu_s": 0.40, "peak_growth": 123}
```

`measure` runs `prepare` once (a fresh process: it writes what the cases read under `work`), then
`repeats` rounds of every case, the order reversed every other round so that the floor and each
alternative meet the same minutes of a shared machine (pairs alternate). A case's figure is the
median over its rounds; its ratio to the floor is the median over rounds of case / floor, each
pair measured a moment apart (or, where a case returns `floor_s`, the floor it measured in its own
process a moment before).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORK = os.path.join(HERE, "_work")
MARK = "BENCH-RESULT "


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """What a benchmark declares: its cases, its floor, the alternatives and its sizes.

    `cases` maps each case to what it measures; `floor` is the case the others are divided by
    (None: no floor); `sizes` maps "small" (a smoke run of seconds) and "full" (the figures in
    the benchmark log) to the parameters `run_case` and `prepare` get. `evict`: the cases that
    start with the work directory dropped from the page cache (cold reads). `apart`: cases run
    after every round of the others, not between them (one that frees much fresh memory slows
    whatever runs next). `requires`: cases run only where the named parameter is set
    (`--set NAME=VALUE`). Two parameters are the harness's: `only` ("a,b") runs those cases and
    the floor, `cpu_devices` overrides the field. `columns`: extra figures for the table, (key,
    header, format). `cpu_devices`: virtual CPU devices of each process (None: the real devices).
    `script`: a benchmark with its own runner (the seed's own case), run as
    `python benchmarks/<script> ARGS`. `render`: `module:function(result, out_dir) -> markdown`
    for a table of its own (default: `render.table`, one row per case). `env`: variables set in a
    case's process from its start (an allocator's `MALLOC_*`).
    """

    name: str
    summary: str
    cases: dict[str, str] = dataclasses.field(default_factory=dict)
    floor: str | None = None
    run_case: str = ""
    prepare: str | None = None
    sizes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    repeats: int = 3
    evict: tuple[str, ...] = ()
    apart: tuple[str, ...] = ()
    requires: dict[str, str] = dataclasses.field(default_factory=dict)
    columns: tuple[tuple[str, str, str], ...] = ()
    targets: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_devices: int | None = 8
    script: str | None = None
    render: str | None = None
    env: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


def call(target: str, *args: Any) -> Any:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(*args)


def child(bench: Benchmark, target: str, case: str | None, params: dict, work: str) -> dict:
    """Runs `target(case, params, work)` (or `target(params, work)`) in a fresh process."""
    request = {"target": target, "case": case, "params": params, "work": work}
    request["cpu_devices"] = bench.cpu_devices
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    # BENCH_T0: when the process was asked for, for end-to-end times from an empty process.
    # The repository first, the caller's path after it (packages installed with `--target`).
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env.update(bench.env.get(case or "", {}), PYTHONPATH=path, BENCH_T0=repr(time.time()))
    command = [sys.executable, "-m", "benchmarks.harness", json.dumps(request)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode or not lines:
        raise RuntimeError(
            f"{bench.name} {case or 'prepare'} failed (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def child_main(request: dict) -> None:
    """The fresh process's side of `child`."""
    from benchmarks import bench_model

    bench_model.set_env(request["cpu_devices"])
    args = (request["params"], request["work"])
    if request["case"] is not None:
        args = (request["case"], *args)
    result = call(request["target"], *args) or {}
    print(MARK + json.dumps(result), flush=True)


def measure(
    bench: Benchmark,
    size: str,
    repeats: int | None,
    work: str,
    params: dict | None = None,
    log=print,
) -> dict:
    """Every case of `bench` at `size` (`params` override its parameters), `repeats` rounds; the
    result as `render` reads it."""
    params = dict(bench.sizes[size] if params is None else params)
    if "cpu_devices" in params:  # `--set cpu_devices=N`: N virtual CPU devices (0: the real ones)
        bench = dataclasses.replace(bench, cpu_devices=params.pop("cpu_devices") or None)
    repeats = repeats or (1 if size == "small" else bench.repeats)
    os.makedirs(work, exist_ok=True)
    started, load_before = time.perf_counter(), os.getloadavg()
    prepared = child(bench, bench.prepare, None, params, work) if bench.prepare else {}
    cases = selected(bench, params)
    paired = [c for c in cases if c not in bench.apart]
    rounds: list[dict] = [{} for _ in range(repeats)]
    for r, row in enumerate(rounds):
        for case in paired if r % 2 == 0 else paired[::-1]:
            row[case] = run_one(bench, case, dict(params, _round=r), work, log)
    for r, row in enumerate(rounds):  # after every pair: see `Benchmark.apart`
        for case in (c for c in bench.apart if c in cases):
            row[case] = run_one(bench, case, dict(params, _round=r), work, log)
    return {
        "benchmark": bench.name,
        "size": size,
        "params": params,
        "repeats": repeats,
        "cpu_devices": bench.cpu_devices,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "prepared": prepared,
        "rounds": rounds,
        "summary": summarize(bench, rounds),
    }


def selected(bench: Benchmark, params: dict) -> list[str]:
    """The cases a run measures: those named by `only` ("a,b" or a list) and the floor, else
    every case whose `requires` parameter is set."""
    only = params.get("only")
    if only:
        named = set(only.split(",") if isinstance(only, str) else only)
        if named - set(bench.cases):
            raise ValueError(f"{bench.name} has no case {sorted(named - set(bench.cases))}")
        return [c for c in bench.cases if c in named or c == bench.floor]
    return [c for c in bench.cases if params.get(bench.requires.get(c, ""), True)]


def run_one(bench: Benchmark, case: str, params: dict, work: str, log) -> dict:
    if case in bench.evict:
        evict(work)
    result = child(bench, bench.run_case, case, params, work)
    result["loadavg_1m"] = os.getloadavg()[0]
    log(f"[{bench.name}] round {params['_round'] + 1} {case}: {result['seconds']:.3f} s")
    return result


def summarize(bench: Benchmark, rounds: list[dict]) -> dict[str, dict]:
    """Per case: the median of each numeric figure over the rounds, its min, and x floor."""
    out = {}
    for case in (c for c in bench.cases if any(c in r for r in rounds)):
        runs = [r[case] for r in rounds if case in r]
        keys = [k for k, v in runs[0].items() if isinstance(v, int | float)] if runs else []
        row = {k: statistics.median(run[k] for run in runs) for k in keys}
        row.update(n=len(runs), seconds_min=min(run["seconds"] for run in runs))
        if "floor_s" in row:  # the floor measured in the case's own process
            row["x_floor"] = statistics.median(run["seconds"] / run["floor_s"] for run in runs)
        elif bench.floor and case != bench.floor:
            pairs = [r[case]["seconds"] / r[bench.floor]["seconds"] for r in rounds]
            row["x_floor"] = statistics.median(pairs)
        out[case] = row
    return out


def evict(directory: str) -> None:
    """Every file under `directory`, written back and dropped from the page cache."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests._page_cache import evict as evict_files

    os.sync()
    evict_files(files_of(directory))


def files_of(directory: str) -> list[str]:
    """Every file under `directory`, links left out (their targets are listed where they are)."""
    paths = (os.path.join(root, name) for root, _, names in os.walk(directory) for name in names)
    return [p for p in paths if not os.path.islink(p)]


def machine() -> dict:
    """Cores, memory, versions and commit: what a figure needs beside it to be read."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("keras", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    commit = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "python": platform.python_version(),
        "versions": versions,
        "commit": commit,
    }


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
