"""Fresh process: restore each training-matrix case saved by the test, normally built and deferred, on
the same mesh (another one changes the order of float sums), train on, and compare with the run
that never stopped.

Usage: matrix_resume.py DIRECTORY CASE... ; prints one JSON line {case/build: "ok" or the failure}.
"""

from __future__ import annotations

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the test's own
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import json
import traceback
from pathlib import Path

import keras
import numpy as np

import keras_orbax
from tests import _matrix


def _check(case: _matrix.Case, directory: Path, deferred: bool) -> str:
    with _matrix.policy(case.policy):
        model = _matrix.build(case, deferred=deferred)
        result = keras_orbax.restore_sharded(model, directory / case.name)
        if result.skipped:
            return f"skipped keys: {result.skipped}"
        _matrix.train(model, _matrix.batches()[_matrix.BATCHES_BEFORE :])
        got = _matrix.state(model)
    expected = np.load(directory / f"{case.name}.npz")
    if len(got) != len(expected.files):
        return f"{len(got)} variables, expected {len(expected.files)}"
    for i, value in enumerate(got):
        if not np.array_equal(value, expected[f"v{i}"]):
            variable = (model.variables + model.optimizer.variables)[i]
            return f"{variable.path} differs from the run that never stopped"
    return "ok"


def main() -> None:
    directory, names = Path(sys.argv[1]), sys.argv[2:]
    keras.distribution.set_distribution(_matrix.distribution((2, 4)))
    results = {}
    for name in names:
        case = _matrix.BY_NAME[name]
        for deferred in (False, True) if case.can_defer else (False,):
            label = f"{name}/{'deferred' if deferred else 'built'}"
            try:
                results[label] = _check(case, directory, deferred)
            except Exception:
                results[label] = traceback.format_exc(limit=6)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
