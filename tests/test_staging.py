"""Background saves keep the state as it was while training goes on: on CPU by holding views that
pin the device buffers, elsewhere by copying into host buffers kept from one save to the next."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.write import shard_writer, staging
from keras_orbax._src.write.staging import HostStaging
from tests import _models

# The hidden kernel (16 x _WIDE float32) and its Adam slots just past `shard_writer.PACK_BYTES`.
_WIDE = 16896


@pytest.fixture
def mp(distribution):
    return distribution(_models.model_parallel((2, 4)))


@pytest.fixture(params=["views", "device copies", "copies"])
def held_as(request, monkeypatch):
    """Every way a background save keeps the state: views pinning CPU buffers (what runs here);
    what runs on an accelerator, forced here: copies on the device fetched into warm host buffers
    while training goes on, or, where the device has no room for them, the shards fetched into
    those buffers at once."""
    if request.param != "views":
        monkeypatch.setattr(staging, "views_pin_buffers", lambda platform: False)
    if request.param == "copies":
        monkeypatch.setattr(HostStaging, "_room_for", lambda self, arrays: False)
    return request.param


def _donating_step(arrays: list[jax.Array]) -> list[jax.Array]:
    """What Keras's train step does to the state: new values, the old buffers donated."""
    return jax.jit(lambda state: [a + 1 for a in state], donate_argnums=0)(arrays)


def _shard_values(array: jax.Array) -> list[np.ndarray]:
    """Copies of every buffer of `array` (not `np.asarray(array)`: JAX keeps that, a view)."""
    return [np.array(s.data) for s in array.addressable_shards]


def test_views_of_cpu_shards_pin_every_buffer_until_released(mp):
    """The CPU path holds no copy: the shards given are returned as they are, and a donating step
    leaves every buffer of the arrays (every replica: an array donated in part crashes when used)
    alone until `release`; after it, the arrays are whole and donated as usual."""
    model = _models.mlp(width=32)
    _models.fill_arange(model)
    arrays = [v.value for v in model.variables]
    want = [_shard_values(a) for a in arrays]
    shards = jax.device_get(
        [s.data for a in arrays for s in a.addressable_shards if s.replica_id == 0]
    )
    host_staging = HostStaging()
    host_staging.prepare(arrays)
    try:
        assert staging.views_pin_buffers("cpu")
        held = host_staging.keep(shards, arrays)
        assert all(h is s for h, s in zip(held, shards, strict=True))
        del held, shards
        stepped = _donating_step(arrays)
        assert not any(a.is_deleted() for a in arrays)
        for array, values in zip(arrays, want, strict=True):
            for got, value in zip(_shard_values(array), values, strict=True):
                np.testing.assert_array_equal(got, value)
        np.testing.assert_array_equal(_shard_values(stepped[0])[0], want[0][0] + 1)
        host_staging.release()
        _donating_step(arrays)  # whole arrays, nothing viewing them: donated, no crash
        assert all(a.is_deleted() for a in arrays)
    finally:
        host_staging.close()


def test_buffers_prepared_ahead_are_lent_once_and_reused_after_release(mp, monkeypatch):
    monkeypatch.setattr(staging, "views_pin_buffers", lambda platform: False)
    model = _models.mlp(width=32)
    arrays = [v.value for v in model.variables]
    shards = [np.asarray(s.data) for a in arrays for s in a.addressable_shards if s.replica_id == 0]
    host_staging = HostStaging()
    host_staging.prepare(arrays)
    try:
        first = host_staging.keep(shards, arrays)
        while_lent = host_staging.keep(
            shards, arrays
        )  # a save still holding the first set gets others
        assert not {id(b) for b in first} & {id(b) for b in while_lent}
        host_staging.release()
        again = host_staging.keep(shards, arrays)
        assert {id(b) for b in again} <= {id(b) for b in first + while_lent}
        for copy, shard in zip(again, shards, strict=True):
            np.testing.assert_array_equal(copy, shard)
            assert copy.flags.c_contiguous and copy.ctypes.data != shard.ctypes.data
    finally:
        host_staging.close()


class _Record(keras.callbacks.Callback):
    """The state at each epoch end, listed before the checkpoint callback."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.states.append(_models.values(self.model.variables + self.model.optimizer.variables))


def test_each_background_save_holds_its_own_epoch_while_training_goes_on(tmp_path, mp, held_as):
    """Four background saves while training goes on: every step holds exactly its epoch's state
    (a view that did not pin its buffer, or a buffer handed back before its write finished,
    would hold a later epoch's values)."""
    keras.utils.set_random_seed(5)
    model = _models.compile_adam(_models.mlp(width=_WIDE))
    # Held as the fixture says only past PACK_BYTES: smaller arrays are assembled on the host.
    assert not shard_writer.is_packed(model.get_layer("hidden").kernel.value)
    record = _Record()
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16), dtype="float32"), rng.random((32, 8), dtype="float32")
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    model.fit(
        x, y, batch_size=8, epochs=4, verbose=0, shuffle=False, callbacks=[record, checkpoint]
    )

    for epoch, want in enumerate(record.states):
        restored = _models.compile_adam(_models.mlp(width=_WIDE))
        restored.optimizer.build(restored.trainable_variables)
        keras_orbax.restore_sharded(restored, tmp_path, step=4 * (epoch + 1))
        got = _models.values(restored.variables + restored.optimizer.variables)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_a_save_started_later_writes_the_state_as_it_was_staged(tmp_path, mp):
    """`ModelCheckpoint`'s background save: the shards are copied, the train step then donates
    (here: deletes) every buffer, and only afterwards does Orbax's part of the save run."""
    from keras_orbax._src.write import step_sink, step_writer

    model = _models.compile_adam(_models.mlp(width=32))
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model)
    want = _models.values(model.variables + model.optimizer.variables)
    with step_sink.open_checkpointer(tmp_path, "fast") as checkpointer:
        later = step_writer.write_step(
            checkpointer, model, step=1, blocking=False, start_later=True
        )
        for variable in model.variables + model.optimizer.variables:
            variable.value.delete()
        later.result()

    restored = _models.compile_adam(_models.mlp(width=32))
    restored.optimizer.build(restored.trainable_variables)
    keras_orbax.restore_sharded(restored, tmp_path, step=1)
    got = _models.values(restored.variables + restored.optimizer.variables)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
