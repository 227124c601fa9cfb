"""CPU time of the command line in fresh processes: what a user waits for before any work starts.

    python      `python -c pass`, the floor
    help        `keras-orbax --help` (the console script)
    help_m      `python -m keras_orbax --help`
    inspect     `keras-orbax inspect` of a tiny checkpoint (one Dense layer, written first)

Each figure (`seconds`) is the user + system CPU seconds of the command's process; CPU time, unlike
wall time, hardly moves with what else the machine runs. The tests assert what is imported, never
these figures.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

from benchmarks.harness import REPO

_WRITE = """
import sys, keras_orbax, keras  # keras_orbax first: it chooses the JAX backend
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
keras_orbax.save(model, sys.argv[1], step=1, overwrite=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    return dict(env, PYTHONPATH=REPO)


def prepare(params: dict, work: str) -> None:
    subprocess.run(
        [sys.executable, "-c", _WRITE, os.path.join(work, "ckpt")], env=_env(), check=True
    )


def run_case(case: str, params: dict, work: str) -> dict:
    script = shutil.which("keras-orbax", path=os.path.dirname(sys.executable))
    console = [script] if script else [sys.executable, "-m", "keras_orbax"]
    command = {
        "python": [sys.executable, "-c", "pass"],
        "help": [*console, "--help"],
        "help_m": [sys.executable, "-m", "keras_orbax", "--help"],
        "inspect": [*console, "inspect", os.path.join(work, "ckpt")],
    }[case]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=_env(), stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}
