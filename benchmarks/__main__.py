"""`python -m benchmarks`: every benchmark of keras-orbax through one entry point.

    python -m benchmarks --list                        # every benchmark, its cases and floor
    python -m benchmarks reshard --size small          # a smoke run: seconds, one round
    python -m benchmarks reshard --repeats 5 --set layout=2d
    python -m benchmarks reshard --set only=other      # those cases (comma-separated) and the floor
    python -m benchmarks gpu_memory --set cpu_devices=8   # N virtual CPU devices per process
    python -m benchmarks render reshard --write-docs   # the saved result into the log
    python -m benchmarks seed_case -- --config 2b      # the seed's own runner: ARGS after --

A run saves its result to benchmarks/_work/results/NAME.json (`--json`) and renders it beside;
`--write-docs` also replaces NAME's section of docs/dev/benchmarks-log.md, its plots beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks import harness, render
from benchmarks.registry import BENCHMARKS, BY_NAME


def listing() -> str:
    lines = []
    for b in BENCHMARKS:
        lines.append(f"{b.name:14s} {b.summary}")
        if b.script:
            lines.append(f"{'':14s}   own runner: benchmarks/{b.script} (ARGS after --)")
        for case, what in b.cases.items():
            mark = " (floor)" if case == b.floor else ""
            lines.append(f"{'':14s}   {case}{mark}: {what}")
    return "\n".join(lines)


def value(text: str):
    """A `--set` value: JSON where it parses (numbers, true), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("name", nargs="?", help="a benchmark, or `render NAME`")
    p.add_argument("target", nargs="?", help="with `render`: the benchmark to render")
    p.add_argument("--list", action="store_true", help="list every benchmark and exit")
    p.add_argument("--size", choices=("small", "full"), default="full")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default: the benchmark's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a parameter")
    p.add_argument("--work", default=None, help="default: benchmarks/_work/NAME")
    p.add_argument("--json", default=None, help="default: benchmarks/_work/results/NAME.json")
    p.add_argument("--write-docs", action="store_true", help="NAME's section of the log")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parse(argv[: len(argv) - len(extra) - (1 if extra or "--" in argv else 0)])
    if args.list or not args.name:
        print(listing())
        return 0
    rendering = args.name == "render"
    name = args.target if rendering else args.name
    if name not in BY_NAME:
        raise SystemExit(f"unknown benchmark {name!r}; `python -m benchmarks --list` names them")
    bench = BY_NAME[name]
    if bench.script:  # its own runner (the seed's case)
        command = [sys.executable, "-m", "benchmarks." + bench.script.removesuffix(".py"), *extra]
        return subprocess.run(command, cwd=harness.REPO, check=False).returncode
    path = args.json or os.path.join(harness.WORK, "results", f"{name}.json")
    if rendering:
        with open(path) as f:
            result = json.load(f)
    else:
        params = dict(bench.sizes[args.size])
        params.update({k: value(v) for k, v in (item.split("=", 1) for item in args.set)})
        work = os.path.abspath(args.work or os.path.join(harness.WORK, name))
        result = harness.measure(bench, args.size, args.repeats, work, params=params)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(render.write(bench, result, os.path.dirname(os.path.abspath(path)), args.write_docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
