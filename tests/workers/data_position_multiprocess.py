"""Worker for tests/test_data_position.py: the input's position under jax.distributed (run by
tests/_harness.py), 2 processes x 4 devices, each process reading its own half of every batch
from its own shuffled `PyDataset`.

args: {"directory": str}

Three fits in one launch: uninterrupted; stopped after 6 batches (epoch 1, batch 2) once the step
is saved; resumed into a model built with another seed. Reports whether every local shard of every
variable equals the uninterrupted run's, the batches the resumed fit read from training's start,
and the positions the step holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

import keras_orbax
from keras_orbax._src.format import data_state
from tests import _models
from tests._worker_util import init_worker, write_result

LOCAL_BATCH, BATCHES, EPOCHS, STOP = 4, 4, 3, 6


class _Half(keras.utils.PyDataset):
    """This process's half of each global batch, counting its reads."""

    def __init__(self, process: int) -> None:
        super().__init__()
        rng = np.random.default_rng(process)
        self.x = rng.random((BATCHES * LOCAL_BATCH, 16), dtype="float32")
        self.y = rng.random((BATCHES * LOCAL_BATCH, 8), dtype="float32")
        self.reads = 0

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads += 1
        part = slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH)
        return self.x[part], self.y[part]


class _Stop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if int(self.model.optimizer.iterations) == STOP:
            self.model.stop_training = True


class _CountFromTrainBegin(keras.callbacks.Callback):
    def __init__(self, data: _Half) -> None:
        super().__init__()
        self.data = data

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.data.reads = 0  # Keras's build of a fresh model reads one batch before


def _local(model: keras.Model) -> list[np.ndarray]:
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    return [np.asarray(shard.data) for v in variables for shard in v.value.addressable_shards]


def _fit(model: keras.Model, data: _Half, callbacks: list[Any]) -> None:
    model.fit(data, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=callbacks)


def main() -> None:
    ctx = init_worker()
    directory = Path(ctx.args["directory"])
    distribution = _models.model_parallel((2, 4))
    distribution.auto_shard_dataset = False  # each process feeds its own half of every batch
    keras.distribution.set_distribution(distribution)

    keras.utils.set_random_seed(1)
    uninterrupted = _models.compile_adam(_models.mlp())
    _fit(uninterrupted, _Half(ctx.process_id), [])

    keras.utils.set_random_seed(1)
    stopped = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(directory, save_freq=STOP, max_to_keep=None)
    _fit(stopped, _Half(ctx.process_id), [checkpoint, _Stop()])

    keras.utils.set_random_seed(2)  # another init and another global NumPy and Python state
    resumed = _models.compile_adam(_models.mlp())
    data = _Half(ctx.process_id)
    checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None, resume=True)
    _fit(resumed, data, [_CountFromTrainBegin(data), checkpoint])

    unequal = [
        i
        for i, (got, want) in enumerate(zip(_local(resumed), _local(uninterrupted), strict=True))
        if not np.array_equal(got, want)
    ]
    positions = data_state.read_all(directory / str(STOP))
    write_result(
        {
            "restored_step": None if checkpoint.restored is None else checkpoint.restored.step,
            "unequal_shards": unequal,
            "reads": data.reads,
            "positions": {
                str(p): [s["kind"], s["epoch"], s["batch"]] for p, s in positions.items()
            },
            "process_count": jax.process_count(),
        }
    )


if __name__ == "__main__":
    main()
