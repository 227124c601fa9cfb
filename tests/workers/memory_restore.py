"""Saves (`save DIR`) or restores deferred (`restore DIR`) a 64 MiB model; prints JSON with RSS figures.

`save_h5 DIR` / `restore_h5 DIR` do the same through Keras's `.weights.h5` with a model dominated
by one large embedding. `restore_cut DIR` restores what `save` wrote onto a (1, 8) mesh, whose
regions cut the rows of every saved shard (they are read together, `_coalesce`).

Run in a fresh process so that the peak RSS (VmHWM) belongs to this restore alone.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import keras
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel

import keras_orbax
from tests._rss import status_kib

# keras_orbax imports its verbs on first use: import them now, so that the memory and bytes
# measured below are the restore's, not the loading of its modules.
for _name in keras_orbax.__all__:
    getattr(keras_orbax, _name)


def build() -> keras.Model:
    inputs = keras.Input((2048,))
    x = keras.layers.Dense(4096, name="wide")(inputs)  # 32 MiB kernel
    outputs = keras.layers.Dense(2048, name="narrow")(x)  # 32 MiB kernel
    return keras.Model(inputs, outputs)


def build_embedding() -> keras.Model:
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(32768, 512, name="vocabulary")(inputs)  # 64 MiB
    outputs = keras.layers.Dense(8, name="out")(x)
    return keras.Model(inputs, outputs)


def main(mode: str, directory: str) -> None:
    mesh_shape = (1, 8) if mode == "restore_cut" else (2, 4)
    mesh = DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    layout_map = LayoutMap(mesh)
    layout_map[".*kernel"] = ("batch", "model")
    layout_map[".*embeddings"] = ("batch", "model")
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    if mode == "save":
        keras_orbax.save(build(), directory, step=1)
        return
    if mode == "save_compiled":
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)
        keras_orbax.save(model, directory, step=1)
        return
    if mode == "save_h5":
        build_embedding().save_weights(os.path.join(directory, "m.weights.h5"))
        return
    if mode == "restore_h5":  # warm up what any h5 restore loads and sets up, on a tiny model
        tiny = os.path.join(directory, "tiny.weights.h5")
        keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)]).save_weights(tiny)
        with keras_orbax.deferred_init():
            warm = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
        keras_orbax.restore_sharded(warm, tiny)
    after_imports = status_kib("VmRSS") * 1024
    if mode == "load_model":
        model = keras_orbax.load_model(directory)
        result = keras_orbax.inspect(directory)  # what was read: every array of the step
        bytes_read = result.nbytes
    else:
        with keras_orbax.deferred_init():
            model = build_embedding() if mode == "restore_h5" else build()
        source = os.path.join(directory, "m.weights.h5") if mode == "restore_h5" else directory
        bytes_read = keras_orbax.restore_sharded(model, source).bytes_read
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
    resident = sum(s.data.nbytes for v in variables for s in v.value.addressable_shards)
    print(
        json.dumps(
            {
                "after_imports": after_imports,
                "peak": status_kib("VmHWM") * 1024,
                "resident": resident,
                "bytes_read": bytes_read,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
