"""How tests/data/v0_1_checkpoint was written: by keras-orbax 0.1 (commit 18b3aa9), from its checkout:

    PYTHONPATH=<0.1 checkout> python make_v0_1_checkpoint.py v0_1_checkpoint

then `mv v0_1_checkpoint/expected.npz v0_1_expected.npz`. Not run by the tests.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel

import keras_orbax

mesh = DeviceMesh((2, 4), ("batch", "model"), jax.devices())
layout_map = LayoutMap(mesh)
layout_map[".*kernel"] = ("batch", "model")
keras.distribution.set_distribution(ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
keras.utils.set_random_seed(1)
inputs = keras.Input((8,))
x = keras.layers.Dense(16, name="hidden")(inputs)
x = keras.layers.Dropout(0.25)(x)
outputs = keras.layers.Dense(4, name="head")(x)
model = keras.Model(inputs, outputs, name="v01")
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
rng = np.random.default_rng(0)
x_train, y_train = rng.random((16, 8), dtype="float32"), rng.random((16, 4), dtype="float32")
model.fit(x_train, y_train, batch_size=8, epochs=1, verbose=0)
keras_orbax.save(model, sys.argv[1], step=2, epoch=1)
state = model.variables + model.optimizer.variables
np.savez(
    os.path.join(sys.argv[1], "expected.npz"),
    **{f"v{i}": np.asarray(v.value) for i, v in enumerate(state)},
)
