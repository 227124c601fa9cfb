"""`inspect` and the command line describe a checkpoint from its metadata alone."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import keras_orbax
from tests import _models


def test_inspect_describes_every_variable(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    keras_orbax.save(model, tmp_path, step=5, epoch=2)
    keras_orbax.save(model, tmp_path, step=9, epoch=3)

    info = keras_orbax.inspect(tmp_path, step=5)
    assert info.steps == (5, 9) and info.step == 5 and info.record.epoch == 2
    kernel = info.record.variables["layers/dense/vars/0"]
    assert (kernel.path, kernel.shape, kernel.dtype) == ("hidden/kernel", (16, 32), "float32")
    assert kernel.layout == {
        "mesh_shape": [2, 4],
        "axis_names": ["batch", "model"],
        "partition": ["batch", "model"],
    }
    assert info.nbytes == (16 * 32 + 32 + 32 * 8 + 8) * 4
    assert info.record.model_config["class_name"] == "Functional"

    printed = subprocess.run(
        [sys.executable, "-m", "keras_orbax", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "steps [5, 9]; step 9, epoch 3, 4 variables, 3.2 KiB" in printed
    assert re.search(
        r"layers/dense/vars/0 +hidden/kernel +\(16, 32\) +float32 +2.0 KiB +partition "
        r"\('batch', 'model'\)",
        printed,
    )
    # The one mesh is said once, with the step, not on each row.
    assert "step 9 on mesh (2, 4) ('batch', 'model'):" in printed
    assert printed.count("mesh (2, 4)") == 1


def test_command_line_reports_a_missing_directory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "keras_orbax", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr


def test_a_damaged_other_step_is_said_in_its_row_not_raised(tmp_path):
    """Describing step 1 reads the other steps' records for the summary; step 2's being damaged is
    said in its row (as `verify` would find), and describing step 2 itself raises."""
    from keras_orbax._src.compat import orbax_compat
    from keras_orbax.errors import CorruptCheckpointError

    model = _models.mlp()
    for step in (1, 2):
        keras_orbax.save(model, tmp_path, step=step)
    orbax_compat.step_metadata_file(tmp_path / "2").write_text("{not json")
    info = keras_orbax.inspect(tmp_path, step=1)
    assert [s.step for s in info.summaries] == [1, 2]
    assert info.summaries[0].damaged is None and info.summaries[0].nbytes > 0
    assert "checkpoint step" in info.summaries[1].damaged and "/2" in info.summaries[1].damaged
    assert "damaged: " in str(info).splitlines()[4]
    with pytest.raises(CorruptCheckpointError):
        keras_orbax.inspect(tmp_path, step=2)
