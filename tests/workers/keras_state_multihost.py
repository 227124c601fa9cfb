"""Worker for tests/test_keras_parity.py: two processes save a model whose layer keeps a NumPy
table and an asset beside its variables, sharded across both, and restore it into another build.

args: {"directory": the checkpoint root}
"""

import os

import keras
import numpy as np

from tests._worker_util import init_worker, write_result


class Table(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")
        self.table, self.words = np.zeros((4,), "float32"), ["[UNK]"]

    def call(self, x):
        return x * self.scale + self.table

    def save_own_variables(self, store):
        super().save_own_variables(store)
        store["table"] = self.table

    def load_own_variables(self, store):
        self.scale.assign(store["0"])
        self.table = np.asarray(store["table"])

    def save_assets(self, dir_path):
        with open(os.path.join(dir_path, "words.txt"), "w") as file:
            file.write("\n".join(self.words))

    def load_assets(self, dir_path):
        with open(os.path.join(dir_path, "words.txt")) as file:
            self.words = file.read().split("\n")


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(8, name="head")(Table(name="table")(inputs))
    return keras.Model(inputs, outputs)


def main() -> None:
    ctx = init_worker()
    import keras_orbax

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["head/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, auto_shard_dataset=False)
    )
    saved = build(0)
    table = saved.get_layer("table")
    table.table, table.words = np.arange(4, dtype="float32"), ["[UNK]", "a", "b"]
    keras_orbax.save(saved, ctx.args["directory"], step=1)
    restored = build(1)
    keras_orbax.restore_sharded(restored, ctx.args["directory"])
    kernels = [saved.get_layer("head").kernel.value, restored.get_layer("head").kernel.value]
    shards = [[np.asarray(s.data) for s in k.addressable_shards] for k in kernels]
    write_result(
        {
            "spans_processes": not kernels[1].is_fully_addressable,
            "table": restored.get_layer("table").table,
            "words": restored.get_layer("table").words,
            "kernel_shards_equal": all(np.array_equal(a, b) for a, b in zip(*shards, strict=True)),
        }
    )


if __name__ == "__main__":
    main()
