"""Restores of damaged steps in each read shape, for tests/test_crc32c.py: run in the test's
process (google-crc32c installed) and, as a worker, in one where it is not.

args: {"root": ...}; `root` holds `mlp` and `embed` (intact steps saved with google-crc32c
installed), `mlp_damaged` and `embed_damaged` (the same with one byte flipped). The worker
(1 process, 8 devices) reports `messages(root)`, then saves `root/saved_without` twice (the second
save links its unchanged files) and reports what its restores left unverified.
"""

from __future__ import annotations

import sys
from pathlib import Path

KERNEL = "layers/dense/vars/0"  # the mlp's "hidden" kernel (16, 32) float32: one file, read whole
SHAPES = {  # read shape -> (step directory, layout the restore asks for)
    "whole": ("mlp", None),
    "saved layout": ("embed", ("model", None)),
    "another layout": ("embed", (None, "model")),
}


def embedding(axes: tuple):
    """A (2048, 256) float32 embedding (2 MiB) under a layout splitting it on `axes`."""
    import keras

    mesh = keras.distribution.DeviceMesh((8,), ("model",))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(2048, 256, name="embed")(tokens))


def model_for(shape: str):
    import keras

    from tests import _models

    axes = SHAPES[shape][1]
    if axes is not None:
        return embedding(axes)
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    return model


def messages(root: Path) -> dict[str, str]:
    """Read shape -> the error its restore of the damaged step raised; each intact step is
    restored first, every array checked."""
    import keras_orbax
    from keras_orbax.errors import CorruptCheckpointError

    found = {}
    for shape, (name, _) in SHAPES.items():
        result = keras_orbax.restore_sharded(model_for(shape), root / name)
        assert result.restored and result.unverified == (), result.unverified
        try:
            keras_orbax.restore_sharded(model_for(shape), root / f"{name}_damaged")
        except CorruptCheckpointError as error:
            found[shape] = str(error)
        else:
            found[shape] = "restored"
    return found


def _save_twice(directory: Path) -> list[list[str]]:
    """Saves the embedding at steps 1 and 2 (unchanged: linked) and restores each; returns what
    each restore left unverified."""
    import numpy as np

    import keras_orbax

    model = embedding(("model", None))
    model.weights[0].assign(np.random.default_rng(1).random((2048, 256)).astype("float32"))
    unverified = []
    for step in (1, 2):
        keras_orbax.save(model, directory, step=step)
        result = keras_orbax.restore_sharded(embedding((None, "model")), directory, step=step)
        unverified.append(list(result.unverified))
    return unverified


if __name__ == "__main__":
    sys.modules["google_crc32c"] = None  # not installed: `import google_crc32c` raises ImportError
    sys.modules["isal"] = None  # nor ISA-L, the other CRC-32C
    from tests._worker_util import worker_context, write_result

    root = Path(worker_context().args["root"])
    from keras_orbax._src.format import crc

    write_result(
        {
            "crc32c": crc.CRC32C is not None,
            "messages": messages(root),
            "unverified": _save_twice(root / "saved_without"),
        }
    )
