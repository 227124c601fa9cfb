"""Hostile and broken files, fed to every verb that reads them (`tests/_hostile.py` builds them).

Keras hardened its loaders against shape bombs in `.weights.h5` (keras#22975), zip bombs and
member names outside a `.keras` (#23010, #23101), size lies in npz (#23016); keras-hub against
preset paths outside the preset (#2716). keras-orbax reads all of these and more: safetensors
headers, `zarr.json`, its own step records. Each input x each verb that reads what was damaged
must give one `keras_orbax.errors` error naming the file (the command line: one line on stderr,
a non-zero exit), leave the model `restore_sharded` was given as it was, write nothing outside the
destination, and allocate nothing sized by a declared
value before it is checked against the file (the bombs' peak memory, in one worker process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_orbax import cli
from keras_orbax.errors import KerasOrbaxError
from tests import _hostile

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "workers" / "hostile_bombs.py"
CASES = [
    (name, verb)
    for name, build in _hostile.BUILDERS.items()
    for verb in _hostile.VERBS_BY_NAME[name]
]


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    root = tmp_path_factory.mktemp("intact")
    _hostile.intact(root)
    return root


@pytest.fixture(scope="module")
def built(intact, tmp_path_factory):
    """Each input, built once on first use (no verb changes it: checked by every case)."""
    inputs: dict[str, tuple[Path, _hostile.Hostile]] = {}

    def build(name: str) -> tuple[Path, _hostile.Hostile]:
        if name not in inputs:
            work = tmp_path_factory.mktemp(name)
            inputs[name] = (work, _hostile.BUILDERS[name](intact, work))
        return inputs[name]

    return build


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time."""
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            stat = os.stat(os.path.join(parent, name))
            found[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.mark.parametrize(("name", "verb"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_every_verb_refuses_the_input_naming_its_file(built, tmp_path, capsys, name, verb):
    work, hostile = built(name)
    before = _files(work), _files(tmp_path)
    destination = tmp_path / "destination"
    if verb == "cli":
        capsys.readouterr()
        code = cli.main(["verify", str(hostile.location)])
        out, err = capsys.readouterr()
        assert code != 0 and not out
        assert len(err.splitlines()) == 1, err
        assert str(hostile.named) in err
        assert "(location given" not in err  # said of another library's error
    else:
        model = _hostile.model_for(hostile) if verb == "restore_sharded" else None
        values = [np.asarray(v.value) for v in model.variables] if model is not None else None
        with pytest.raises(KerasOrbaxError) as raised:
            _hostile.run_verb(verb, hostile, destination, model)
        assert str(hostile.named) in str(raised.value)
        if model is not None:  # all or nothing: the model is as it was
            for variable, value in zip(model.variables, values, strict=True):
                np.testing.assert_array_equal(
                    np.asarray(variable.value), value, err_msg=variable.path
                )
    written = {f for f in _files(tmp_path) if not f.startswith(f"{destination}/")}
    assert (_files(work), written) == (before[0], set(before[1]))
    assert not list(work.parent.glob("**/escaped-by-hostile-input.txt"))


def test_the_bombs_are_refused_before_anything_is_allocated_by_their_declared_sizes(
    built, tmp_path
):
    """Each bomb declares at least 128 MiB it does not hold (4 TiB for shapes); reading it by
    its declared size would raise the peak RSS by that much. One worker runs every bomb x verb."""
    cases = []
    for name in _hostile.BOMBS:
        _, hostile = built(name)
        for verb in _hostile.VERBS_BY_NAME[name]:
            # A keras-hub model would cost the worker keras-hub's import: the safetensors bomb
            # goes to `inspect` and `verify`, which open it as every other verb does.
            needs_hub = hostile.architecture != "mlp" and verb not in ("inspect", "verify")
            if verb != "cli" and not needs_hub:
                cases.append([name, verb, str(hostile.location), hostile.architecture])
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="1048576")
    done = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(cases), str(tmp_path / "destination")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for (name, verb, _, _), (error, growth) in zip(cases, results, strict=True):
        assert error.startswith("keras_orbax.errors."), (name, verb, error)
        assert growth < 64 << 20, (name, verb, growth)
