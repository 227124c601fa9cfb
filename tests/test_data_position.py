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
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
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
    def __init__(self, reads: _Reads, batch: int = BATCH, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads, self.batch = reads, batch
        self.x, self.y = _data()

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads.add()
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


class _Reshuffled(_Batches):
    """The Keras `Sequence` idiom: its own order of the samples, drawn again from its own
    generator in `on_epoch_end`."""

    def __init__(self, reads: _Reads) -> None:
        super().__init__(reads)
        self.rng = np.random.default_rng(5)
        self.order = np.arange(len(self.x))

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads.add()
        rows = self.order[i * BATCH : (i + 1) * BATCH]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self) -> None:
        self.order = self.rng.permutation(len(self.x))


class _ReshuffledWithState(_Reshuffled):
    """Opts in to being positioned: its own state, JSON-safe, saved with each step."""

    def get_state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"])


class _Records:
    """A grain data source: record i is (x[i], y[i]); BATCH records read count one batch."""

    def __init__(self, reads: _Reads, batches: int = BATCHES) -> None:
        self.reads = reads
        self.x, self.y = _data(batches)

    def __len__(self) -> int:
        return len(self.x)

    def __repr__(self) -> str:  # grain checks a saved state against the source by its repr
        return f"_Records({len(self.x)})"

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads.add()
        return self.x[i], self.y[i]


class _UnnamedRecords(_Records):
    """A data source with Python's own repr, which names its address: another in each process."""

    __repr__ = object.__repr__


def _grain_map(reads: _Reads, records: int = BATCHES * BATCH, batch: int = BATCH) -> Any:
    import grain

    source = _Records(reads, records // BATCH)
    return grain.MapDataset.source(source).shuffle(seed=3).batch(batch)


def _grain_iter(reads: _Reads) -> Any:
    return _grain_map(reads).to_iter_dataset()


def _grain_loader(reads: _Reads, source: type[_Records] = _Records, workers: int = 2) -> Any:
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's DataLoader reads its absl flags; pytest parses none
        flags.FLAGS.mark_as_parsed()

    sampler = grain.samplers.IndexSampler(
        BATCHES * BATCH, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=3,
        num_epochs=1,
    )  # fmt: skip
    return grain.DataLoader(
        data_source=source(reads),
        sampler=sampler,
        operations=[grain.transforms.Batch(BATCH)],
        worker_count=workers,
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
    save_freq: str | int = "epoch",
    saved_at: int | None = None,
) -> tuple[keras_orbax.ModelCheckpoint, int]:
    """Runs the three fits; asserts the resumed state is the uninterrupted one, exactly, and
    returns the resumed fit's checkpoint and the batches it read. The stopped fit saves at its
    stop (preempted: after `saved_at` batches, by default `stop_after`) and every `save_freq`."""
    keras.utils.set_random_seed(1)
    uninterrupted = _mlp()
    uninterrupted.fit(**inputs(), epochs=epochs, shuffle=shuffle, verbose=0)

    keras.utils.set_random_seed(1)
    stopped = _mlp()
    checkpoint = keras_orbax.ModelCheckpoint(directory, save_freq=save_freq, max_to_keep=None)
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
    assert checkpoint.restored is not None
    assert checkpoint.restored.step == (stop_after if saved_at is None else saved_at)
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


# -- a PyDataset that orders itself -----------------------------------------------------------


def test_a_pydataset_that_reorders_itself_resumes_exactly_from_its_own_state(tmp_path, mp, reads):
    # Stopped in its second epoch, whose order the dataset drew in its own on_epoch_end.
    _, read = _resume(
        tmp_path / "ckpt", lambda: {"x": _ReshuffledWithState(reads)}, reads, stop_after=6,
        shuffle=False, epochs=2,
    )  # fmt: skip
    assert read == 2 * BATCHES - 6


def test_a_pydataset_that_reorders_itself_without_a_state_warns(tmp_path, mp, reads):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=6, max_to_keep=None)
    _mlp().fit(_Reshuffled(reads), epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint])
    resumed = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, resume=True)
    with pytest.warns(
        KerasOrbaxWarning,
        match=r"_Reshuffled defines its own on_epoch_end .* Define _Reshuffled.get_state\(\)",
    ):
        _mlp().fit(_Reshuffled(reads), epochs=2, shuffle=False, verbose=0, callbacks=[resumed])


class _ReshuffledWithArrayState(_Reshuffled):
    def get_state(self) -> np.ndarray:
        return self.order

    def set_state(self, state: np.ndarray) -> None:
        self.order = state


def test_a_pydataset_state_that_is_not_json_warns_and_is_not_saved(tmp_path, mp, reads):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=2, max_to_keep=None)
    with pytest.warns(
        KerasOrbaxWarning, match=r"get_state\(\) returned a ndarray that is not JSON"
    ):
        _mlp().fit(_ReshuffledWithArrayState(reads), epochs=1, verbose=0, callbacks=[checkpoint])
    from keras_orbax._src.format import data_state

    assert "dataset" not in data_state.read(tmp_path / "2", 0)


# -- grain's DataLoader, and inputs that changed -----------------------------------------------


def test_a_grain_loader_over_a_source_with_pythons_repr_reads_no_trained_batch(
    tmp_path, mp, reads, recwarn
):
    pytest.importorskip("grain", reason="grain is the `grain` extra of keras-orbax")
    _, read = _resume(
        tmp_path / "ckpt", lambda: {"x": _grain_loader(reads, _UnnamedRecords, workers=0)},
        reads, stop_after=2, shuffle=False, per_batch=BATCH, epochs=1,
    )  # fmt: skip
    assert read == BATCHES - 2
    assert not [w for w in recwarn if issubclass(w.category, KerasOrbaxWarning)]


_CHANGED = {  # what the step was saved with, what the resumed fit reads, what it says
    "grain_fewer_records": (
        _grain_map,
        lambda reads: _grain_map(reads, records=3 * BATCH),
        r"the input changed: saved \{'batches': 4, 'batch_size': 8\}, now \{'batches': 3, ",
    ),
    "grain_larger_batches": (
        _grain_map,
        lambda reads: _grain_map(reads, records=8 * BATCH, batch=2 * BATCH),
        r"the input changed: .* now \{'batches': 4, 'batch_size': 16\}",
    ),
    "pydataset_smaller_batches": (
        _Batches,
        lambda reads: _Batches(reads, batch=BATCH // 2),
        "The PyDataset's batches hold 4 samples, those of the checkpoint's run 8",
    ),
}


@pytest.mark.parametrize("change", list(_CHANGED))
def test_an_input_of_another_length_or_batch_size_is_not_resumed_silently(
    tmp_path, mp, reads, change
):
    pytest.importorskip("grain", reason="grain is the `grain` extra of keras-orbax")
    saved, resumed, says = _CHANGED[change]
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    fit = {"epochs": 1, "shuffle": False, "verbose": 0}
    _mlp().fit(saved(reads), **fit, callbacks=[_StopAfter(2), checkpoint])  # step 2: batch 2 of 4
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, resume=True)
    with pytest.warns(KerasOrbaxWarning, match=says):
        _mlp().fit(resumed(reads), **fit, callbacks=[checkpoint])
    assert checkpoint.restored is not None and checkpoint.restored.step == 2


def test_a_grain_iter_dataset_of_another_length_warns_when_the_resumed_epoch_ends(
    tmp_path, mp, reads
):
    # An IterDataset says its length only once read: the saving fit read a whole epoch of 4.
    pytest.importorskip("grain", reason="grain is the `grain` extra of keras-orbax")
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    fit = {"epochs": 2, "verbose": 0}
    _mlp().fit(_grain_iter(reads), **fit, callbacks=[_StopAfter(6), checkpoint])  # epoch 1, batch 2
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, resume=True)
    shorter = _grain_map(reads, records=3 * BATCH).to_iter_dataset()
    with pytest.warns(KerasOrbaxWarning, match="epoch 2 of fit's grain input had 3 batches, .* 4"):
        _mlp().fit(shorter, **fit, callbacks=[checkpoint])


# -- Keras's accelerator path: one batch read ahead ---------------------------------------------


class _AcceleratorJax(types.ModuleType):
    """`jax` as Keras's trainer sees it on a GPU: its `JAXEpochIterator` then reads each batch
    one ahead of the one trained (`_one_batch_ahead_iterator`) when no distribution is set."""

    def __init__(self) -> None:
        super().__init__("jax")

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    @staticmethod
    def default_backend() -> str:
        return "gpu"


@pytest.fixture
def accelerator_path(monkeypatch):
    from keras.src.backend.jax import trainer

    monkeypatch.setattr(trainer, "jax", _AcceleratorJax())


class _ReadsAtFirstBatch(keras.callbacks.Callback):
    def __init__(self, reads: _Reads) -> None:
        super().__init__()
        self.reads, self.seen = reads, None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.reads.reset()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.seen = self.seen if self.seen is not None else self.reads.count()


def test_keras_reads_one_batch_ahead_on_the_accelerator_path(accelerator_path, reads):
    probe = _ReadsAtFirstBatch(reads)
    _mlp().fit(_Batches(reads), epochs=1, verbose=0, callbacks=[probe])
    assert probe.seen == 2  # the batch trained, and the next


@pytest.mark.parametrize("kind", ["arrays", "pydataset", "grain_map", "tf_data"])
def test_inputs_resume_exactly_when_keras_reads_one_batch_ahead(
    tmp_path, accelerator_path, reads, kind
):
    module = {"grain_map": "grain", "tf_data": "tensorflow"}.get(kind, "keras")
    pytest.importorskip(module, reason=f"{kind} inputs need {module}, an optional extra")
    inputs = {
        "arrays": lambda: _arrays(reads),
        "pydataset": lambda: {"x": _Batches(reads)},
        "grain_map": lambda: {"x": _grain_map(reads)},
        "tf_data": lambda: {"x": _tf_dataset(reads)},
    }[kind]
    with warnings.catch_warnings():
        # No fallback to reading and dropping the trained batches.
        warnings.filterwarnings("error", "fit's input cannot be put back", KerasOrbaxWarning)
        _, read = _resume(
            tmp_path / "ckpt", inputs, reads, stop_after=6, shuffle=True,
            per_batch=BATCH if kind == "grain_map" else 1, epochs=2, save_freq=6,
        )  # fmt: skip
    if kind == "tf_data":  # its prefetch read ahead, and its checkpoint holds what it read
        assert read <= 2 * BATCHES - 6
    elif kind != "arrays":  # arrays are sliced, not read
        assert read == 2 * BATCHES - 6


def test_a_preemption_waits_a_batch_where_keras_read_tf_data_ahead_of_the_notice(
    tmp_path, accelerator_path, reads
):
    pytest.importorskip("tensorflow", reason="tf_data inputs need tensorflow, an optional extra")
    # SIGTERM after batch 6, which Keras read with batch 7: the save comes after batch 7, whose
    # read (batch 8) came after the notice.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "fit's input cannot be put back", KerasOrbaxWarning)
        _, read = _resume(
            tmp_path / "ckpt", lambda: {"x": _tf_dataset(reads)}, reads, stop_after=6,
            shuffle=False, epochs=2, saved_at=7,
        )  # fmt: skip
    assert read <= 2 * BATCHES - 7


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
