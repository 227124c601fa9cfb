"""Worker for tests/test_export_preset.py: a tiny Gemma loaded sharded over both processes' devices
with `keras_orbax.from_preset`, trained one step, written back with `keras_orbax.save_to_preset`.

args: {"start": the preset to load, "out": the preset to write, "values": an .npz that process 0
writes with every trained weight, gathered, for the test to compare}
"""

import keras
import numpy as np
from jax.experimental import multihost_utils

import keras_orbax
from tests._hub import TINY_GEMMA
from tests._worker_util import init_worker, write_result


def main() -> None:
    import keras_hub

    ctx = init_worker()
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    distribution.auto_shard_dataset = False  # each process feeds its own (here the same) batch
    keras.distribution.set_distribution(distribution)
    backbone = keras_orbax.from_preset(keras_hub.models.GemmaBackbone, ctx.args["start"])
    spans = not backbone.token_embedding.embeddings.value.is_fully_addressable
    backbone.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    rng = np.random.default_rng(0)  # the same batch on every process
    x = {
        "token_ids": rng.integers(1, TINY_GEMMA["vocabulary_size"], (8, 8)).astype("int32"),
        "padding_mask": np.ones((8, 8), "int32"),
    }
    backbone.fit(x, np.ones((8, 8, TINY_GEMMA["hidden_dim"]), "float32"), epochs=1, verbose=0)
    keras_orbax.save_to_preset(backbone, ctx.args["out"], window_bytes=256)
    values = {
        w.path: np.asarray(multihost_utils.process_allgather(w.value, tiled=True))
        for w in backbone.weights
    }
    if ctx.process_id == 0:
        np.savez(ctx.args["values"], **values)
    write_result({"spans_processes": spans})


if __name__ == "__main__":
    main()
