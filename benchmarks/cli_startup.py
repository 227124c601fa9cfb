"""CPU time of the command line in fresh processes: what a user waits for before any work starts.

    help        `keras-orbax --help` (the console script)
    help_m      `python -m keras_orbax --help`
    inspect     `keras-orbax inspect` of a tiny checkpoint (one Dense layer, written first)
    python      `python -c pass`, the floor

Each figure is the user + system CPU seconds of the child (`resource.getrusage(RUSAGE_CHILDREN)`),
the median of `--repeats` runs; CPU time, unlike wall time, hardly moves with what else the machine
runs. The tests assert what is imported, never these figures.

Usage: python benchmarks/cli_startup.py [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WRITE = """
import sys, keras_orbax, keras  # keras_orbax first: it chooses the JAX backend
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
keras_orbax.save(model, sys.argv[1], step=1)
"""


def cpu_seconds(command: list[str], env: dict[str, str]) -> float:
    """User + system CPU seconds of one run of `command` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per case (median shown)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["PYTHONPATH"] = ROOT
    script = shutil.which("keras-orbax", path=os.path.dirname(sys.executable))
    console = [script] if script else [sys.executable, "-m", "keras_orbax"]
    workdir = tempfile.mkdtemp(prefix="cli_startup_")
    try:
        ckpt = os.path.join(workdir, "ckpt")
        subprocess.run([sys.executable, "-c", _WRITE, ckpt], env=env, check=True)
        cases = {
            "python": [sys.executable, "-c", "pass"],
            "help": [*console, "--help"],
            "help_m": [sys.executable, "-m", "keras_orbax", "--help"],
            "inspect": [*console, "inspect", ckpt],
        }
        figures = {}
        for name, command in cases.items():
            runs = [cpu_seconds(command, env) for _ in range(args.repeats)]
            figures[name] = {"median_s": statistics.median(runs), "min_s": min(runs)}
            print(f"{name:>8}  {figures[name]['median_s']:.2f} s CPU (min {min(runs):.2f} s)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
