"""Every built-in optimizer, precision policy, gradient accumulation, quantized and LoRA layers: save
mid-training, restore in a fresh process (normally built and deferred), train on,
and the state is identical to a run that never stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import keras_orbax
from tests import _matrix

WORKER = Path(__file__).parent / "workers" / "matrix_resume.py"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, str]:
    """Saves every case on a (2, 4) mesh after a few batches, keeps training it to get the expected
    state, then restores each in a fresh process on the same mesh (on another, the float sums of a
    sharded matmul run in another order, so training on could not be bit-identical). Two workers,
    each started once its half of the cases is saved, so the second half's saves overlap the first
    worker's restores."""
    import keras

    directory = tmp_path_factory.mktemp("matrix")
    halves = [_matrix.CASES[::2], _matrix.CASES[1::2]]
    workers = []
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_matrix.distribution((2, 4)))
    try:
        data = _matrix.batches()
        for half in halves:
            for case in half:
                with _matrix.policy(case.policy):
                    model = _matrix.build(case)
                    _matrix.train(model, data[: _matrix.BATCHES_BEFORE])
                    keras_orbax.save(model, directory / case.name, step=_matrix.BATCHES_BEFORE)
                    _matrix.train(model, data[_matrix.BATCHES_BEFORE :])
                    expected = _matrix.state(model)
                arrays = {f"v{i}": v for i, v in enumerate(expected)}
                np.savez(directory / f"{case.name}.npz", **arrays)
            command = [sys.executable, str(WORKER), str(directory), *(case.name for case in half)]
            log = directory / f"worker_{len(workers)}"
            with open(f"{log}.out", "wb") as out, open(f"{log}.err", "wb") as err:
                # The session's environment, its XLA flags too: training on must match bit for bit.
                workers.append((log, subprocess.Popen(command, stdout=out, stderr=err)))
    except BaseException:
        for _, worker in workers:
            worker.kill()
        raise
    finally:
        keras.distribution.set_distribution(previous)
    results: dict[str, str] = {}
    for log, worker in workers:
        try:
            returncode = worker.wait(timeout=900)
        finally:
            worker.kill()
        assert returncode == 0, Path(f"{log}.err").read_text()[-3000:]
        results.update(json.loads(Path(f"{log}.out").read_text().strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("case", _matrix.CASES, ids=lambda case: case.name)
def test_resume_in_a_fresh_process_is_exact(resumed, case):
    builds = ["built", "deferred"] if case.can_defer else ["built"]
    outcomes = {build: resumed[f"{case.name}/{build}"] for build in builds}
    assert outcomes == dict.fromkeys(builds, "ok")
