"""The training run of the local-tier tests, shared by `tests/test_local_tier.py` and its
worker (`tests/workers/local_tier_train.py`), so that both train exactly the same steps."""

from __future__ import annotations

import keras
import numpy as np

import keras_orbax
from tests import _models

EPOCHS, BATCHES, BATCH = 3, 4, 8
LOCAL_MAX_TO_KEEP = 2


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = BATCHES * BATCH
    return rng.random((n, 16), dtype="float32"), rng.random((n, 8), dtype="float32")


def build() -> keras.Model:
    model = _models.mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def train(
    directory, local_directory, *, seed: int = 1, extra_callbacks=(), resume: bool = True
) -> tuple[keras.Model, keras_orbax.ModelCheckpoint]:
    """Fits 3 epochs of 4 batches under ModelParallel (2, 4): persistent steps at each epoch's
    end, a local step after every batch."""
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    keras.utils.set_random_seed(seed)
    model = build()
    checkpoint = keras_orbax.ModelCheckpoint(
        directory,
        local_directory=local_directory,
        local_save_freq=1,
        local_max_to_keep=LOCAL_MAX_TO_KEEP,
        max_to_keep=None,
        resume=resume,
    )
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=[checkpoint, *extra_callbacks],
    )
    return model, checkpoint


def state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables + model.metrics_variables)
