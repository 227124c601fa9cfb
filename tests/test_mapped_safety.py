"""A restored model's weights are its own: by default no buffer is a mapping of a shard file, so a
later write to the checkpoint (`cp -r` over it, `rsync --inplace`) or a truncation changes nothing
in a process that restored it, and cannot kill it. `KERAS_ORBAX_MAP_SHARDS=1` maps the large saved
shards instead (docs/format.md): the files must then stay as written while the model lives.

Each restore runs in a fresh process (`workers/mapped_safety.py`), where a SIGBUS from a truncated
mapping shows as a crash instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.storage import mapped
from keras_orbax.errors import KerasOrbaxWarning
from tests import _models
from tests.workers import mapped_safety as worker

ROOT = Path(__file__).parent.parent
SHARDS = 16  # two kernels, 8 shard files each
WEIGHTS = ("first/kernel", "first/bias", "second/kernel", "second/bias")


@pytest.fixture
def saved(tmp_path, distribution) -> str:
    """A checkpoint of the worker's model with random weights, and those weights in saved.npz."""
    if not mapped._is_local(os.stat(tmp_path).st_dev):
        pytest.skip(f"{tmp_path} is not on a local filesystem: its files are never mapped")
    distribution(_models.model_parallel((2, 4)))
    model = worker.build()
    rng = np.random.default_rng(5)
    for weight in model.weights:
        weight.assign(rng.standard_normal(weight.shape).astype("float32"))
    directory = str(tmp_path / "ckpt")
    keras_orbax.save(model, directory, step=1)
    np.savez(f"{directory}/saved.npz", **{w.path: np.asarray(w.value) for w in model.weights})
    return directory


def _restore_and_damage(directory: str, *args: str, map_shards: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(mapped.ENVIRONMENT_VARIABLE, None)
    if map_shards is not None:
        env[mapped.ENVIRONMENT_VARIABLE] = map_shards
    done = subprocess.run(
        [sys.executable, str(Path(worker.__file__)), directory, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _overwritten(directory: str) -> bool:
    data = np.fromfile(f"{directory}/{worker.OVERWRITTEN}", "float32", count=256 * 256)
    return bool((data == 7.0).all())


@pytest.mark.parametrize("setting", [None, "0"])
def test_files_changed_after_a_restore_change_nothing_in_the_model(saved, setting):
    figures = _restore_and_damage(saved, "truncate", map_shards=setting)

    assert os.path.getsize(f"{saved}/{worker.TRUNCATED}") == 0  # the damage was done
    assert _overwritten(saved)
    assert figures["maps"] == []  # no buffer of the model was a mapping of the checkpoint
    assert figures["equal"] == dict.fromkeys(WEIGHTS, True)


def test_the_opt_in_maps_the_shards_and_the_model_sees_the_files(saved):
    figures = _restore_and_damage(saved, map_shards="1")

    shard_files = {line.split()[-1] for line in figures["maps"]}
    assert len(shard_files) == SHARDS, figures["maps"]
    assert all(line.split()[1].endswith("p") for line in figures["maps"])  # private
    assert os.path.realpath(f"{saved}/{worker.OVERWRITTEN}") in shard_files
    # The contract of the opt-in: the buffers are the files' pages, so a write shows.
    assert _overwritten(saved)
    assert figures["equal"]["second/kernel"] is False
    assert figures["equal"]["first/kernel"] is True


def test_the_setting_is_read_at_each_restore_and_an_unknown_one_warns_and_copies(monkeypatch):
    monkeypatch.setenv(mapped.ENVIRONMENT_VARIABLE, " True")
    assert mapped.enabled() is True
    monkeypatch.setenv(mapped.ENVIRONMENT_VARIABLE, "off")
    assert mapped.enabled() is False
    monkeypatch.setenv(mapped.ENVIRONMENT_VARIABLE, "always")
    mapped._setting.cache_clear()  # it warns once per value and process
    with pytest.warns(KerasOrbaxWarning, match=r"KERAS_ORBAX_MAP_SHARDS='always' is neither on"):
        assert mapped.enabled() is False
