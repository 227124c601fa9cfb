"""Saves pause Python's cyclic garbage collector while they hold their objects, and leave it as
they found it.

A background save keeps tens of thousands of small objects (JAX's per-device shards, futures,
records) until it commits; collections that ran meanwhile moved them to the old generation, and
every ten or so saves a full collection stalled the training loop (docs/benchmarks.md, "The first
save of a process"). No timings here: which collections run, and the collector's state after.
"""

from __future__ import annotations

import gc
import threading

import keras
import numpy as np

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.runtime import gc_pause
from tests import _models
from tests.test_background_saver import _automatic_collections_run


class _Watched(keras_orbax.ModelCheckpoint):
    """Says whether a save is in flight: in the hook, or in the background until committed."""

    in_hook = False

    def on_epoch_end(self, epoch, logs=None):
        self.in_hook = True
        try:
            super().on_epoch_end(epoch, logs)
        finally:
            self.in_hook = False

    def saving(self) -> bool:
        pending = self._saves.pending
        return self.in_hook or (pending is not None and not pending.done.is_set())


def _deep_mlp() -> keras.Model:
    inputs = keras.Input((16,))
    x = inputs
    for i in range(8):  # 16 arrays of Adam state and 16 of weights, 8 shards each
        x = keras.layers.Dense(64, name=f"dense_{i}")(x)
    return _models.compile_adam(keras.Model(inputs, x))


def _fit(model: keras.Model, checkpoint: keras.callbacks.Callback, epochs: int) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16), dtype="float32"), rng.random((32, 64), dtype="float32")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False, callbacks=[checkpoint])


def test_background_saves_run_no_collection_and_resume_the_collector(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _deep_mlp()
    checkpoint = _Watched(tmp_path / "ckpt", max_to_keep=None)
    during_saves: list[tuple[int, str]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and checkpoint.saving():
            during_saves.append((info["generation"], threading.current_thread().name))

    gc.callbacks.append(on_gc)
    try:
        _fit(model, checkpoint, epochs=6)
    finally:
        gc.callbacks.remove(on_gc)

    assert step_dirs.committed_steps(tmp_path / "ckpt") == [4, 8, 12, 16, 20, 24]
    # Without the pause, 51 collections ran during these saves. With it, none can, but the hook
    # allocates a few objects (a frame's `super()`, the pause's own context) before the collector
    # is paused: one of them may find a young collection due, once in a few hundred saves.
    assert len(during_saves) <= 1, during_saves
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled(tmp_path):
    model = _models.compile_adam(_models.mlp())
    gc.disable()
    try:
        x, y = np.ones((8, 16), "float32"), np.ones((8, 8), "float32")
        checkpoint = keras_orbax.ModelCheckpoint(tmp_path / "ckpt")
        model.fit(x, y, epochs=2, verbose=0, callbacks=[checkpoint])
        keras_orbax.save(model, tmp_path / "sync", step=0)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_holds_overlap_across_threads_and_the_last_release_resumes():
    assert gc.isenabled()
    first = gc_pause.hold()
    held, released = threading.Event(), threading.Event()

    def background() -> None:
        release = gc_pause.hold()
        held.set()
        released.wait()
        release()

    thread = threading.Thread(target=background)
    thread.start()
    held.wait(timeout=60)
    first()
    first()  # a second call of one release does nothing
    assert not _automatic_collections_run()  # the background thread's hold is still on
    released.set()
    thread.join(timeout=60)
    assert gc.isenabled() and _automatic_collections_run()


def test_an_export_runs_no_collection(tmp_path, distribution):
    """The commit protocol pauses the collector for every export: at 9B, when each run of a
    column-cut kernel was a Python object, its full collections were a fifth of `save_weights`
    (docs/benchmarks.md). With young collections due every 50 allocations, none runs."""
    distribution(_models.model_parallel((1, 8)))
    inputs = keras.Input((4096,))
    x = inputs
    for i in range(4):  # kernels of 4096 rows, each cut across its columns into 8 shards
        x = keras.layers.Dense(256, name=f"dense_{i}")(x)
    model = keras.Model(inputs, x)
    keras_orbax.save_weights(model, tmp_path / "first.weights.h5")  # the export's lazy imports
    collections: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    # A young collection every 50 allocations: the export's own would run dozens of them.
    thresholds = gc.get_threshold()
    gc.set_threshold(50, *thresholds[1:])
    gc.callbacks.append(on_gc)
    try:
        keras_orbax.save_weights(model, tmp_path / "model.weights.h5")
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
    # One young collection may be due when the pause ends, as the export returns.
    assert len(collections) <= 1, collections
    assert gc.isenabled()
    restored = keras.Model.from_config(model.get_config())
    restored.load_weights(tmp_path / "model.weights.h5")
    for got, want in zip(restored.weights, model.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
