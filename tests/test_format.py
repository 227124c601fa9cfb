"""The on-disk format is plain Orbax: readable without keras-orbax or Keras (docs/format.md)."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import tensorstore as ts

import keras_orbax
from tests import _models


def test_arrays_and_metadata_read_with_plain_orbax_and_tensorstore(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=24, epoch=3)
    kernel = np.asarray(model.get_layer("hidden").kernel.value)

    state = ocp.load(tmp_path / "24", checkpointable_name="state")
    np.testing.assert_array_equal(np.asarray(state["layers"]["dense"]["vars"]["0"]), kernel)
    meta = ocp.checkpointables_metadata(tmp_path / "24").custom_metadata["keras_orbax"]
    assert meta["format_version"] == 2 and meta["step"] == 24 and meta["epoch"] == 3
    entry = next(v for v in meta["variables"] if v["path"] == "hidden/kernel")
    assert entry["array"] == "layers.dense.vars.0"

    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": f"{tmp_path}/24/state/{entry['array']}/"},
        }
    ).result()
    np.testing.assert_array_equal(store[0:8, 8:16].read().result(), kernel[0:8, 8:16])


def test_a_crashed_save_leaves_no_committed_step(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    keras_orbax.save(model, tmp_path, step=1)
    (tmp_path / "2.orbax-checkpoint-tmp-99" / "state").mkdir(parents=True)  # what a crash leaves
    assert keras_orbax.inspect(tmp_path).steps == (1,)
    assert keras_orbax.restore_sharded(_models.mlp(), tmp_path).step == 1
