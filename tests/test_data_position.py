"""The input's position saved with every step: a fit stopped mid-epoch and resumed reads none of
the batches it trained before, and ends exactly where an uninterrupted fit does, for each kind of
input (arrays shuffled by Keras, PyDataset, grain map/iter/loader with workers); where the input
has no position (a generator, tf.data, another batch size), it says so and reads and drops them.

Each case trains three models in real fits: straight through; stopped by a real SIGTERM after
`stop_after` batches (the callback saves that step and stops `fit`); rebuilt with another seed and
resumed by the same `fit` call. The input counts what it reads in the resumed fit.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import KerasOrbaxWarning
from tests import _models

BATCH = 8
BATCHES = 4  # per epoch
EPOCHS = 3


class _StopAfter(keras.callbacks.Callback):
    """Sends this process a SIGTERM after `n` batches; list it before the checkpoint."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.seen += 1
        if self.seen == self.n:
            os.kill(os.getpid(), signal.SIGTERM)


def _data(batches: int = BATCHES) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = batches * BATCH
    return rng.random((n, 16), dtype="float32"), rng.random((n, 8), dtype="float32")


class _Reads:
    """Batches read, counted in a file: grain's worker processes append to it too."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, n: int = 1) -> None:
        with open(self.path, "a") as f:
            f.write("x" * n)

    def count(self, per_batch: int = 1) -> int:
        return len(self.path.read_text()) // per_batch if self.path.exists() else 0

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)


class _CountFromTrainBegin(keras.callbacks.Callback):
    """Starts the count when training starts: before it, Keras's `fit` reads one batch to build
    a model whose metrics are not built yet (`_symbolic_build`), in every fit."""

    def __init__(self, reads: _Reads) -> None:
        super().__init__()
        self.reads = reads

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.reads.reset()


class _Batches(keras.utils.PyDataset):
    def __init__(self, reads: _Reads, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads = reads
        self.x, self.y = _data()

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads.add()
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


class _Records:
    """A grain data source: record i is (x[i], y[i]); BATCH records read count one batch."""

    def __init__(self, reads: _Reads) -> None:
        self.reads = reads
        self.x, self.y = _data()

    def __len__(self) -> int:
        return len(self.x)

    def __repr__(self) -> str:  # grain checks a saved state against the source by its repr
        return f"_Records({len(self.x)})"

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads.add()
        return self.x[i], self.y[i]


def _grain_map(reads: _Reads) -> Any:
    import grain

    return grain.MapDataset.source(_Records(reads)).shuffle(seed=3).batch(BATCH)


def _grain_iter(reads: _Reads) -> Any:
    return _grain_map(reads).to_iter_dataset()


def _grain_loader(reads: _Reads) -> Any:
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's DataLoader reads its absl flags; pytest parses none
        flags.FLAGS.mark_as_parsed()

    sampler = grain.samplers.IndexSampler(
        BATCHES * BATCH, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=3,
        num_epochs=1,
    )  # fmt: skip
    return grain.DataLoader(
        data_source=_Records(reads),
        sampler=sampler,
        operations=[grain.transforms.Batch(BATCH)],
        worker_count=2,
    )


def _mlp() -> keras.Model:
    return _models.compile_adam(_models.mlp())


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables + model.metrics_variables)


def _resume(
    directory: Path,
    inputs: Callable[[], dict[str, Any]],
    reads: _Reads,
    *,
    stop_after: int,
    shuffle: bool,
    per_batch: int = 1,
    epochs: int = EPOCHS,
) -> tuple[keras_orbax.ModelCheckpoint, int]:
    """Runs the three fits; asserts the resumed state is the uninterrupted one, exactly, and
    returns the resumed fit's checkpoint and the batches it read."""
    keras.utils.set_random_seed(1)
    uninterrupted = _mlp()
    uninterrupted.fit(**inputs(), epochs=epochs, shuffle=shuffle, verbose=0)

    keras.utils.set_random_seed(1)
    stopped = _mlp()
    checkpoint = keras_orbax.ModelCheckpoint(directory, save_freq="epoch", max_to_keep=None)
    stopped.fit(
        **inputs(), epochs=epochs, shuffle=shuffle, verbose=0,
        callbacks=[_StopAfter(stop_after), checkpoint],
    )  # fmt: skip
    assert checkpoint.preempted

    keras.utils.set_random_seed(2)  # another init, and another global NumPy and Python state
    resumed = _mlp()
    checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None, resume=True)
    resumed.fit(
        **inputs(), epochs=epochs, shuffle=shuffle, verbose=0,
        callbacks=[_CountFromTrainBegin(reads), checkpoint],
    )  # fmt: skip
    assert checkpoint.restored is not None and checkpoint.restored.step == stop_after
    for variable, got, want in zip(
        resumed.variables + resumed.optimizer.variables + resumed.metrics_variables,
        _state(resumed),
        _state(uninterrupted),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want, err_msg=variable.path)
    return checkpoint, reads.count(per_batch)


@pytest.fixture
def mp(distribution):
    return distribution(_models.model_parallel((2, 4)))


@pytest.fixture
def reads(tmp_path) -> _Reads:
    return _Reads(tmp_path / "reads")


def _arrays(reads: _Reads) -> dict[str, Any]:
    x, y = _data()
    return {"x": x, "y": y, "batch_size": BATCH}


INPUTS = {
    "arrays": _arrays,
    "pydataset": lambda reads: {"x": _Batches(reads)},
    "grain_map": lambda reads: {"x": _grain_map(reads)},
    "grain_iter": lambda reads: {"x": _grain_iter(reads)},
    "grain_loader_workers": lambda reads: {"x": _grain_loader(reads)},
}


# Stopped after 1 batch (epoch 0), 6 (epoch 1, batch 2), 8 (an epoch's end), 11 (epoch 2, batch 3).
@pytest.mark.parametrize("stop_after", [1, 6, 8, 11])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in_order"])
@pytest.mark.parametrize("kind", ["arrays", "pydataset"])
def test_keras_inputs_resume_exactly_reading_no_trained_batch(
    tmp_path, mp, reads, kind, shuffle, stop_after
):
    _, read = _resume(
        tmp_path / "ckpt", lambda: INPUTS[kind](reads), reads, stop_after=stop_after,
        shuffle=shuffle,
    )  # fmt: skip
    if kind != "arrays":  # arrays are sliced, not read: their exactness is the point
        assert read == EPOCHS * BATCHES - stop_after


@pytest.mark.parametrize("kind", ["grain_map", "grain_iter", "grain_loader_workers"])
def test_grain_resumes_exactly_reading_no_trained_batch(tmp_path, mp, reads, kind):
    pytest.importorskip("grain", reason="grain is the `grain` extra of keras-orbax")
    # Two epochs, stopped in the second (batch 2): each epoch starts the loader's worker processes.
    _, read = _resume(
        tmp_path / "ckpt", lambda: INPUTS[kind](reads), reads, stop_after=6, shuffle=False,
        per_batch=BATCH, epochs=2,
    )  # fmt: skip
    assert read == 2 * BATCHES - 6


def _tf_dataset(reads: _Reads) -> Any:
    import tensorflow as tf

    x, y = _data()

    def count(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        reads.add()
        return a, b

    # The shuffle's seeds are this op seed and TensorFlow's global seed, which each run's
    # `keras.utils.set_random_seed` sets: the same pipeline in every run, as a rerun script has.
    tf.random.set_seed(0)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=3, reshuffle_each_iteration=False)
        .batch(BATCH)
        .map(lambda a, b: tf.numpy_function(count, [a, b], [tf.float32, tf.float32]))
        .map(lambda a, b: (tf.ensure_shape(a, (BATCH, 16)), tf.ensure_shape(b, (BATCH, 8))))
    )
    options = tf.data.Options()  # the counter is state outside the pipeline: not checkpointed
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return dataset.with_options(options)


def test_tf_data_resumes_exactly_reading_no_trained_batch(tmp_path, mp, reads):
    pytest.importorskip(
        "tensorflow", reason="tf.data inputs need TensorFlow, which keras-orbax does not install"
    )
    _, read = _resume(
        tmp_path / "ckpt", lambda: {"x": _tf_dataset(reads)}, reads, stop_after=6, shuffle=False
    )
    # tf.data reads ahead of the batches taken (its autotuned prefetch), and its checkpoint holds
    # what it had read: fewer than the 6 batches left, and none of the 6 trained.
    assert read <= EPOCHS * BATCHES - 6


def test_a_generator_has_no_position_and_is_read_and_dropped(tmp_path, mp, reads):
    x, y = _data()

    def generator() -> Any:  # 6 batches, one epoch of unknown length
        for i in range(6):
            reads.add()
            j = i % BATCHES
            yield x[j * BATCH : (j + 1) * BATCH], y[j * BATCH : (j + 1) * BATCH]

    with pytest.warns(KerasOrbaxWarning, match="a Python generator has no position") as caught:
        _, read = _resume(
            tmp_path / "ckpt", lambda: {"x": generator()}, reads, stop_after=2, shuffle=False,
            epochs=1,
        )  # fmt: skip
    # Keras's generator adapter reads 2 batches before training (to learn their spec) and yields
    # them again; the other 4 are read after: all 6, the 2 trained before included (an input
    # put at its position would read the 4 it trains: 2 after training starts).
    assert read == 4
    assert sum("cannot be put back" in str(w.message) for w in caught) == 1


def test_an_input_of_unknown_length_is_read_and_dropped_and_says_why(tmp_path, mp, reads):
    """keras-hub's `fit` (on strings or arrays) trains on a grain dataset it builds, unshuffled,
    repeated for every epoch, read by one iterator, with `steps_per_epoch` declared for it: no
    position is saved, the trained batches are read and dropped, and the warning says so without
    naming a `steps_per_epoch` the user never passed as theirs, nor "None batches"."""
    import grain

    def inputs() -> dict[str, Any]:
        dataset = grain.MapDataset.source(_Records(reads)).batch(BATCH)
        return {"x": dataset.repeat(2).to_iter_dataset(), "steps_per_epoch": BATCHES}

    with pytest.warns(KerasOrbaxWarning, match="cannot be put back") as caught:
        _resume(tmp_path / "ckpt", inputs, reads, stop_after=6, shuffle=False, epochs=2)
    (message,) = [str(w.message) for w in caught if "cannot be put back" in str(w.message)]
    assert "None batches" not in message
    assert f"its epochs of {BATCHES} batches (steps_per_epoch, passed to fit or declared" in message


def test_another_batch_size_is_not_positioned_and_says_so(tmp_path, mp, reads):
    x, y = _data()
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=3, max_to_keep=None)
    _mlp().fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[checkpoint])
    resumed = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, resume=True)
    with pytest.warns(KerasOrbaxWarning, match="the input changed: saved .*'batch_size': 8"):
        _mlp().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[resumed])


def test_each_step_holds_the_position_of_each_process(tmp_path, mp, reads):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=2, max_to_keep=None)
    _mlp().fit(_Batches(reads), epochs=2, verbose=0, callbacks=[checkpoint])
    from keras_orbax._src.format import data_state

    positions = {step: data_state.read_all(tmp_path / str(step)) for step in (2, 4, 6)}
    assert {s: (p[0]["kind"], p[0]["epoch"], p[0]["batch"]) for s, p in positions.items()} == {
        2: ("py_dataset", 0, 2),
        4: ("py_dataset", 1, 0),  # the epoch's last batch: the next one's start
        6: ("py_dataset", 1, 2),
    }
    assert all(list(p) == [0] for p in positions.values())  # one process here
    assert "rng" in positions[6][0]  # fit's default shuffle=True draws the order from it


def test_inspect_shows_the_position(tmp_path, mp, reads, capsys):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=3, max_to_keep=None)
    _mlp().fit(_Batches(reads), epochs=1, verbose=0, callbacks=[checkpoint])
    from keras_orbax import cli

    assert cli.main(["inspect", f"{tmp_path}/3", "--json"]) in (0, None)
    described = json.loads(capsys.readouterr().out)
    assert (described["epoch"], described["batch"]) == (0, 3)
    assert described["data_position"] == {"0": {"kind": "py_dataset", "epoch": 0, "batch": 3}}
    assert cli.main(["inspect", f"{tmp_path}/3"]) in (0, None)
    # Numbered as the save line (`Epoch 1, batch 3: saving step 3`): epoch 1, its 3rd batch.
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: steps [3]; step 3, epoch 1, batch 3, ")
    assert "input position: process 0: py_dataset, epoch 1, batch 3" in out
    assert re.search(r"\n +3 +1 +3 ", out)  # the step table's row: step, epoch, batch


def test_each_process_resumes_its_own_shard_of_the_data(tmp_path):
    # 2 processes x 4 devices, each reading its own half of every batch from its own shuffled
    # PyDataset; stopped at epoch 1, batch 2 (tests/workers/data_position_multiprocess.py).
    from tests._harness import WORKERS_DIR, run_workers

    results = run_workers(
        WORKERS_DIR / "data_position_multiprocess.py", 2, 4, {"directory": str(tmp_path)}
    )
    for result in results:
        assert result["process_count"] == 2
        assert result["restored_step"] == 6
        assert result["unequal_shards"] == []  # every local shard equals the uninterrupted run's
        assert result["reads"] == EPOCHS * BATCHES - 6  # none of the 6 trained batches again
        assert result["positions"] == {"0": ["py_dataset", 1, 2], "1": ["py_dataset", 1, 2]}
