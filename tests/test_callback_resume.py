"""A fit stopped anywhere and resumed with `ModelCheckpoint(resume=True)` ends exactly where an
uninterrupted fit does, whatever the input and the optimizer.

Each case trains three models in real fits: one straight through; one stopped by a real SIGTERM
after `stop_after` batches (the callback saves that step and stops `fit`); one built with another
seed and resumed from the directory by the same `fit` call. The resumed model's every variable
(weights, optimizer slots and counters, gradient accumulators, metric accumulators, Dropout's seed
state) must equal the uninterrupted one's exactly.

Then: a latest step whose record cannot be read is passed over, with a warning, for the newest
readable one; and what `verbose=1` prints when `fit` resumes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax import ModelCheckpoint
from keras_orbax._src.format import step_dirs
from keras_orbax.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    KerasOrbaxWarning,
    UnsupportedVersionError,
)
from tests import _models

BATCH = 8


class _StopAfter(keras.callbacks.Callback):
    """Sends this process a SIGTERM after `n` batches; list it before the checkpoint."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.seen += 1
        if self.seen == self.n:
            os.kill(os.getpid(), signal.SIGTERM)


class _Batches(keras.utils.PyDataset):
    """The arrays in batches, by index: a PyDataset with a length."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // BATCH

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


def _mlp_data(batches: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = batches * BATCH
    return rng.random((n, 16), dtype="float32"), rng.random((n, 8), dtype="float32")


def _arrays(batches: int, data=_mlp_data) -> Callable[[], dict[str, Any]]:
    x, y = data(batches)
    return lambda: {"x": x, "y": y, "batch_size": BATCH}


def _pydataset(batches: int) -> Callable[[], dict[str, Any]]:
    x, y = _mlp_data(batches)
    return lambda: {"x": _Batches(x, y)}


def _generator(batches: int) -> Callable[[], dict[str, Any]]:
    """A fresh one-shot generator per fit, without `steps_per_epoch`: the epoch's length is unknown."""
    x, y = _mlp_data(batches)

    def batches_of() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(batches):
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    return lambda: {"x": batches_of()}


def _full_model() -> keras.Model:
    return _models.compile_adam(_models.full_model())  # Dropout: its seed state must resume too


def _mlp(
    width: int = 32, steps_per_execution: int = 1, **optimizer_kwargs: Any
) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        model = _models.mlp(width)
        optimizer = keras.optimizers.Adam(1e-2, **optimizer_kwargs)
        model.compile(
            optimizer=optimizer,
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
        return model

    return build


def _variables(model: keras.Model) -> list[keras.Variable]:
    return model.variables + model.optimizer.variables + model.metrics_variables


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(_variables(model))


def _resume_exactly(
    directory,
    build,
    inputs,
    *,
    epochs: int,
    stop_after: int,
    save_freq: str | int = "epoch",
    batches_per_call: int = 1,
) -> tuple[keras_orbax.RestoreResult, keras.callbacks.History]:
    """Runs the three fits; asserts the resumed state is the uninterrupted one, exactly."""
    keras.utils.set_random_seed(1)
    uninterrupted = build()
    uninterrupted.fit(**inputs(), epochs=epochs, shuffle=False, verbose=0)

    keras.utils.set_random_seed(1)
    stopped = build()
    checkpoint = keras_orbax.ModelCheckpoint(directory, save_freq=save_freq, max_to_keep=None)
    stopped.fit(
        **inputs(), epochs=epochs, shuffle=False, verbose=0,
        callbacks=[_StopAfter(stop_after), checkpoint],
    )  # fmt: skip
    assert checkpoint.preempted
    assert step_dirs.committed_steps(directory)[-1] == stop_after * batches_per_call

    keras.utils.set_random_seed(2)  # another init: the restore must overwrite all of it
    resumed = build()
    checkpoint = keras_orbax.ModelCheckpoint(
        directory, save_freq=save_freq, max_to_keep=None, resume=True
    )
    history = resumed.fit(
        **inputs(), epochs=epochs, shuffle=False, verbose=0, callbacks=[checkpoint]
    )
    assert checkpoint.restored is not None
    assert checkpoint.restored.step == stop_after * batches_per_call
    for variable, got, want in zip(
        _variables(resumed), _state(resumed), _state(uninterrupted), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=variable.path)
    return checkpoint.restored, history


@pytest.fixture
def mp(distribution):
    return distribution(_models.model_parallel((2, 4)))


# 4 batches per epoch, 3 epochs; (epoch, batch) is what the stopped run's last step records.
@pytest.mark.parametrize(
    ("build", "inputs", "stop_after", "position"),
    [
        (_full_model, _arrays(4, lambda b: _models.training_data(b * BATCH)), 6, (1, 2)),
        (_mlp(), _arrays(4), 8, (2, None)),  # the epoch's known last batch: that epoch is done
        (_mlp(), _pydataset(4), 6, (1, 2)),
    ],
    ids=["arrays_mid_epoch", "arrays_last_batch", "pydataset_with_length"],
)
def test_known_steps_per_epoch_resume_exactly(tmp_path, mp, build, inputs, stop_after, position):
    restored, history = _resume_exactly(tmp_path, build, inputs, epochs=3, stop_after=stop_after)
    assert (restored.record.epoch, restored.record.batch) == position
    assert history.epoch == list(range(position[0], 3))


def test_several_steps_per_execution_resume_exactly(tmp_path, mp):
    # Two batches a call of the train function (Keras 3.16 stacks them into one super-batch,
    # asked of the input the resume positions): 4 batches an epoch, stopped after 3 calls.
    build = _mlp(steps_per_execution=2)
    restored, history = _resume_exactly(
        tmp_path, build, _arrays(4), epochs=3, stop_after=3, batches_per_call=2
    )
    assert (restored.record.epoch, restored.record.batch) == (1, 2)
    assert history.epoch == [1, 2]


@pytest.mark.parametrize(("stop_after", "position"), [(8, (0, 8)), (12, (0, 12))])
def test_a_generator_of_unknown_length_resumes_exactly(tmp_path, mp, stop_after, position):
    # One epoch of 12 batches (a generator is exhausted after one epoch). Its length is unknown,
    # so even a save after its last batch records the batches done, not the epoch: resuming reads
    # and drops them, and (after 12) trains nothing more.
    restored, history = _resume_exactly(
        tmp_path, _mlp(), _generator(12), epochs=1, stop_after=stop_after
    )
    assert (restored.record.epoch, restored.record.batch) == position
    assert history.epoch == [0]


def test_mid_epoch_saves_of_a_generator_record_the_batches_done(tmp_path, mp):
    model = _mlp()()
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=4, max_to_keep=None)
    model.fit(**_generator(12)(), epochs=1, verbose=0, callbacks=[checkpoint])
    records = {
        s: step_dirs.read_record(tmp_path / str(s)) for s in step_dirs.committed_steps(tmp_path)
    }
    assert {s: (r.epoch, r.batch) for s, r in records.items()} == {
        4: (0, 4),
        8: (0, 8),
        12: (0, 12),
    }


# 3 batches per epoch, accumulating 2: updates apply after batches 2, 4, 6, 8.
@pytest.mark.parametrize(
    ("stop_after", "position"),
    [(3, (1, None)), (4, (1, 1)), (5, (1, 2))],
    ids=["epoch_end_mid_accumulation", "accumulation_boundary", "mid_accumulation"],
)
def test_gradient_accumulation_resumes_exactly(tmp_path, mp, stop_after, position):
    build = _mlp(gradient_accumulation_steps=2)
    restored, _ = _resume_exactly(tmp_path, build, _arrays(3), epochs=3, stop_after=stop_after)
    assert (restored.record.epoch, restored.record.batch) == position
    # Step names count batches; `iterations` counts applied updates.
    assert restored.step == stop_after
    model = build()
    keras_orbax.restore_sharded(model, tmp_path, stop_after)
    assert int(model.optimizer.iterations) == stop_after // 2


def test_gradient_accumulation_saves_every_batch_without_skipping(tmp_path, mp):
    # `optimizer.iterations` stands still on every other batch; each batch's save still happens.
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=1, max_to_keep=None)
    _mlp(gradient_accumulation_steps=2)().fit(
        **_arrays(3)(), epochs=2, verbose=0, callbacks=[checkpoint]
    )
    assert step_dirs.committed_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


@pytest.fixture
def mixed_float16():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy(previous)


def test_loss_scaling_resumes_exactly(tmp_path, mp, mixed_float16):
    build = _mlp()
    assert isinstance(build().optimizer, keras.optimizers.LossScaleOptimizer)
    _resume_exactly(tmp_path, build, _arrays(4), epochs=3, stop_after=6)


# -- a damaged latest step ----------------------------------------------------------------------


def _largest_array_file(step_dir) -> Any:
    """The largest shard file the step alone holds (a kernel's or its optimizer slot's; an
    incremental save hard-links the files of unchanged arrays to the step before)."""
    state = step_dir / "state"
    files = [
        f
        for f in state.rglob("*")
        if f.is_file() and "c" in f.relative_to(state).parts[1:] and f.stat().st_nlink == 1
    ]
    return max(files, key=lambda f: f.stat().st_size)


def _change_digit(path, after: str) -> None:
    """Adds 1 to the first digit after `after` in the file: it still parses, and says another
    thing (an epoch, a position)."""
    text = path.read_text()
    at = text.index(after) + len(after)
    at += next(i for i, c in enumerate(text[at:]) if c.isdigit())
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])


def _damage(step_dir, how: str) -> str:
    """Damages the step as a power loss, a bad disk or a failing mount could; returns the damaged
    file's name, as the warning names it."""
    metadata = step_dir / "_CHECKPOINT_METADATA"
    if how == "compact_data_byte":  # the chunks of Orbax's OCDBT database: no CRC of their own
        data = max((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        return str(data)
    if how == "data_state_digit":  # the input would resume at another batch
        position = step_dir / "data_state" / "process_0.json"
        _change_digit(position, '"epoch"')
        return str(position)
    if how == "record_digit":  # the record's epoch: fit would resume at another epoch
        _change_digit(metadata, '"epoch"')  # the record's: Orbax's own fields hold none
        return str(metadata)
    if how == "missing":
        metadata.unlink()
    elif how == "not_json":  # also what a read failing with EIO leaves: no record
        metadata.write_text('{"custom_metadata": {"keras_orb')
    elif how == "bad_record":  # valid JSON, with a keras-orbax record that is not one
        metadata.write_text('{"custom_metadata": {"keras_orbax": {"format_version": "x"}}}')
    elif how == "array_bit_flipped":  # same size, same index: only the checksum tells
        with open(_largest_array_file(step_dir), "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x40]))
    else:  # array_truncated
        os.truncate(_largest_array_file(step_dir), 10)
    return ""


@pytest.mark.parametrize(
    "how",
    [
        "missing",
        "not_json",
        "bad_record",
        "array_bit_flipped",
        "array_truncated",
        "compact_data_byte",
        "data_state_digit",
        "record_digit",
    ],
)
def test_a_damaged_latest_step_is_moved_aside_for_the_newest_intact(tmp_path, mp, how):
    inputs = _arrays(2)  # 2 batches per epoch
    # Compact: chunks of random values too large for OCDBT's B-tree nodes, in its data files.
    format, build = ("compact", _mlp(256)) if how.startswith("compact") else ("fast", _mlp())
    keras.utils.set_random_seed(1)
    uninterrupted = build()
    saving = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, format=format)
    uninterrupted.fit(**inputs(), epochs=3, shuffle=False, verbose=0, callbacks=[saving])
    assert step_dirs.committed_steps(tmp_path) == [2, 4, 6]
    file = _damage(tmp_path / "6", how)
    if file:  # what only a checksum tells: verify says so, and so does a restore that reads it
        with pytest.raises(CorruptCheckpointError, match=re.escape(file)):
            keras_orbax.verify(tmp_path, step=6)
        if how != "data_state_digit":  # the input's position: the callback's to read
            with pytest.raises(CorruptCheckpointError, match=re.escape(file)):
                keras_orbax.restore_sharded(build(), tmp_path, step=6)
    damaged = sorted(p.relative_to(tmp_path / "6") for p in (tmp_path / "6").rglob("*"))
    earlier = tmp_path / "6.unreadable"  # set aside by an earlier resume: never overwritten
    earlier.mkdir()
    (earlier / "keep").write_text("x")

    keras.utils.set_random_seed(2)
    resumed = build()
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=1, resume=True, format=format)
    aside = tmp_path / "6.unreadable-2"
    with pytest.warns(
        KerasOrbaxWarning,
        match=rf"(?s)Step 6 of .* cannot be restored, so fit resumes from step 4, the newest "
        rf"intact one. Step 6 was moved aside to '{aside}' \(nothing is deleted.*Step 6 is "
        rf"damaged: CorruptCheckpointError: .*{re.escape(file)}",
    ):
        history = resumed.fit(
            **inputs(), epochs=3, shuffle=False, verbose=0, callbacks=[checkpoint]
        )
    assert checkpoint.restored is not None and checkpoint.restored.step == 4
    assert history.epoch == [2]  # the epoch that step 6 had ended, trained again
    # Step 6 written anew and readable; retention (max_to_keep=1) deleted 2 and 4, which this
    # run superseded, and never what was set aside.
    assert step_dirs.committed_steps(tmp_path) == [6]
    assert keras_orbax.restore_sharded(build(), tmp_path).step == 6
    assert keras_orbax.inspect(tmp_path).step == 6
    assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == damaged  # all of it, moved
    assert (earlier / "keep").read_text() == "x"
    for variable, got, want in zip(
        _variables(resumed), _state(resumed), _state(uninterrupted), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=variable.path)
    _the_step_moved_aside_is_inspected(aside, tmp_path, how)


def _the_step_moved_aside_is_inspected(aside, root, how) -> None:
    """The warning says to inspect what was moved aside: `inspect`, `verify` and `diff` read it as
    the step it was, and name its damage, not "no committed step"."""
    # Its record, or the input position inspect shows: what resume could not read.
    if how in ("missing", "not_json", "bad_record", "record_digit", "data_state_digit"):
        for verb in (keras_orbax.inspect, keras_orbax.verify):
            with pytest.raises(CorruptCheckpointError, match=re.escape(str(aside))):
                verb(aside)
        return
    info = keras_orbax.inspect(aside)
    assert (info.step, info.directory, info.record.epoch) == (6, aside, 3)
    assert info.steps == (6,) and str(info).startswith(f"{aside}: steps [6]; step 6")
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(aside))):
        keras_orbax.verify(aside)
    found = keras_orbax.diff(root, aside)  # the step written anew against the one set aside
    assert (found.only_a, found.only_b, found.changed) == ([], [], {})
    assert found.b == str(aside)


@pytest.mark.parametrize("passes", [True, False], ids=["passing", "lasting"])
def test_an_io_error_is_retried_before_a_step_is_moved_aside(tmp_path, mp, caplog, passes):
    """A read of step 6 that fails with EIO from the kernel (its largest array file served by an
    ext4 filesystem that is shut down) is tried again. One that passes (the filesystem is mounted
    again before the second attempt, as an NFS server comes back) resumes from step 6; one that
    lasts moves step 6 aside, and the warning says it was an I/O error, with its errno: the step
    may well be intact."""
    from keras_orbax._src.storage import commit
    from tests import _faults

    inputs, root = _arrays(2), tmp_path / "ckpt"
    keras.utils.set_random_seed(1)
    uninterrupted = _mlp()()
    saving = keras_orbax.ModelCheckpoint(root, max_to_keep=None)
    uninterrupted.fit(**inputs(), epochs=3, shuffle=False, verbose=0, callbacks=[saving])
    state = root / "6" / "state"
    file = max((f for f in state.rglob("c*") if f.is_file()), key=lambda f: f.stat().st_size)

    keras.utils.set_random_seed(2)
    resumed = _mlp()()
    checkpoint = keras_orbax.ModelCheckpoint(root, max_to_keep=None, resume=True)
    with _faults.failing_file(file, tmp_path / "ext4.img", tmp_path / "disk") as heal:
        healed: list[str] = []

        def come_back(stage: str) -> None:
            if stage == "retry" and passes and not healed:
                healed.append(stage)
                heal()

        with (
            commit.on_stage(come_back),
            caplog.at_level("WARNING", logger="keras_orbax"),
            warnings.catch_warnings(record=True) as warned,
        ):
            warnings.simplefilter("always")
            history = resumed.fit(
                **inputs(), epochs=3, shuffle=False, verbose=0, callbacks=[checkpoint]
            )
    passed_over = [str(w.message) for w in warned if "cannot be restored" in str(w.message)]
    assert checkpoint.restored is not None
    if passes:
        assert passed_over == [] and step_dirs.committed_steps(root) == [2, 4, 6]
        assert checkpoint.restored.step == 6 and history.epoch == []  # all 3 epochs were done
    assert re.search(
        r"Restoring step 6 of .* failed with an I/O error \(errno 5, EIO: Input/output error\); "
        r"trying again in 0.25 s \(attempt 2 of 3\)",
        caplog.text,
    ), caplog.text
    if not passes:
        assert checkpoint.restored.step == 4 and history.epoch == [2]
        (message,) = passed_over
        assert re.search(
            r"Step 6 failed to read with an I/O error \(errno 5, EIO: Input/output error\) in "
            rf"each of 3 attempts: it may be intact.*{re.escape(str(file.relative_to(root / '6')))}",
            message,
        ), message
        assert (root / "6.unreadable").is_dir()  # kept, to be restored once the storage reads
    for variable, got, want in zip(
        _variables(resumed), _state(resumed), _state(uninterrupted), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=variable.path)


def test_a_latest_step_of_a_newer_format_stops_the_resume(tmp_path, mp):
    """A step a newer install wrote is intact: the job must not train on from an older step,
    nor move that step aside."""
    model = _mlp()()
    saving = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    model.fit(**_arrays(2)(), epochs=2, verbose=0, callbacks=[saving])
    metadata = tmp_path / "4" / "_CHECKPOINT_METADATA"
    content = json.loads(metadata.read_text())
    content["custom_metadata"]["keras_orbax"]["format_version"] = 99
    metadata.write_text(json.dumps(content))
    before = _state(model)
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=1, resume=True)
    with pytest.raises(UnsupportedVersionError, match=r"step '.*4' is in keras-orbax format 99"):
        model.fit(**_arrays(2)(), epochs=3, verbose=0, callbacks=[checkpoint])
    assert step_dirs.committed_steps(tmp_path) == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4"]
    for got, want in zip(_state(model), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_no_readable_step_to_resume_from_is_an_error(tmp_path, mp):
    model = _mlp()()
    model.fit(
        **_arrays(2)(), epochs=1, verbose=0, callbacks=[keras_orbax.ModelCheckpoint(tmp_path)]
    )
    _damage(tmp_path / "2", "not_json")
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, resume=True)
    with pytest.raises(CorruptCheckpointError, match=r"(?s)No step of .* \(1 step\):.*step 2: "):
        model.fit(**_arrays(2)(), epochs=2, verbose=0, callbacks=[checkpoint])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]  # left as it was, not moved


def test_resume_waits_for_the_save_a_fit_that_raised_left_in_flight(tmp_path):
    """A `fit` that raised ran no `on_train_end`: its background save of step 4 may still be
    writing. A resumed `fit` in the same process waits for it in `on_train_begin`, then resumes
    from what it committed (it had resumed from the step before, then found step 4 taken)."""
    from keras_orbax._src.training import saving
    from keras_orbax._src.training.pending import PendingSave

    trained = _mlp()()
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_on_background=False)
    trained.fit(**_arrays(2)(), epochs=1, verbose=0, callbacks=[checkpoint])  # step 2
    model = _mlp()()
    resumed = keras_orbax.ModelCheckpoint(tmp_path, resume=True)
    in_flight = PendingSave(4)
    saving._in_flight.add(resumed._saves.directory, in_flight)
    fitting = threading.Thread(
        target=model.fit, kwargs={**_arrays(2)(), "epochs": 3, "verbose": 0, "callbacks": [resumed]}
    )
    fitting.start()
    fitting.join(timeout=1)
    assert fitting.is_alive() and resumed.restored is None  # waiting, before resuming
    trained.fit(**_arrays(2)(), epochs=1, verbose=0)
    keras_orbax.save(trained, tmp_path, step=4, epoch=2)  # what that save commits
    in_flight.done.set()
    fitting.join(timeout=300)
    assert resumed.restored is not None and resumed.restored.step == 4
    assert step_dirs.committed_steps(tmp_path)[-1] == 6  # the third epoch's 2 batches


def test_a_model_changed_on_purpose_is_told_what_works_for_a_resume(tmp_path):
    """`ModelCheckpoint` takes no `strict`: its mismatch error advises what works, and it does."""
    _mlp()().fit(**_arrays(2)(), epochs=1, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "a")])
    wider = _models.compile_adam(_models.mlp(width=64))
    resuming = ModelCheckpoint(tmp_path / "a", resume=True)
    with pytest.raises(CheckpointMismatchError) as raised:
        wider.fit(**_arrays(2)(), epochs=2, verbose=0, callbacks=[resuming])
    message = str(raised.value)
    assert "strict=False to restore only what matches" not in message
    advice = f"keras_orbax.restore_sharded(model, '{tmp_path / 'a'}', strict=False), then fit"
    assert advice in message and "ModelCheckpoint into a new directory" in message
    with pytest.warns(KerasOrbaxWarning, match="strict=False"):  # the advice, followed
        keras_orbax.restore_sharded(wider, tmp_path / "a", strict=False)
    wider.fit(**_arrays(2)(), epochs=1, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "b")])
    assert step_dirs.committed_steps(tmp_path / "b") == [2]


def test_resuming_from_a_step_without_optimizer_state_says_so(tmp_path):
    """A directory of weights-only steps (another callback's): resuming restores the weights, as
    Keras's load_weights would, and warns that the optimizer does not go on where it was."""
    saving = keras_orbax.ModelCheckpoint(tmp_path, save_weights_only=True)
    _mlp()().fit(**_arrays(2)(), epochs=1, verbose=0, callbacks=[saving])
    resumed = keras_orbax.ModelCheckpoint(tmp_path, resume=True)
    with pytest.warns(KerasOrbaxWarning, match="holds no optimizer state"):
        _mlp()().fit(**_arrays(2)(), epochs=2, verbose=0, callbacks=[resumed])
    assert resumed.restored is not None and resumed.restored.step == 2


def test_resuming_mid_epoch_with_other_epochs_warns(tmp_path, recwarn):
    """The batches a mid-epoch resume drops are counted, not recognized: with another batch size
    they are other samples than the checkpoint trained, and the resume says so."""
    saving = keras_orbax.ModelCheckpoint(tmp_path, save_freq=3)  # step 3: batch 3 of 4
    _mlp()().fit(**_arrays(4)(), epochs=1, verbose=0, callbacks=[saving])
    assert step_dirs.committed_steps(tmp_path) == [3]

    same = keras_orbax.ModelCheckpoint(tmp_path, resume=True, save_freq=100)
    _mlp()().fit(**_arrays(4)(), epochs=1, verbose=0, callbacks=[same])
    assert not [w for w in recwarn if "this fit's epochs have" in str(w.message)]

    other = keras_orbax.ModelCheckpoint(tmp_path, resume=True, save_freq=100)
    x, y = _arrays(4)()["x"], _arrays(4)()["y"]
    with pytest.warns(KerasOrbaxWarning) as warned:
        _mlp()().fit(x, y, batch_size=2 * len(x) // 4, epochs=1, verbose=0, callbacks=[other])
    (message,) = [str(w.message) for w in warned if "this fit's epochs have" in str(w.message)]
    assert message.startswith(
        f"Step 3 of '{tmp_path}' was saved after batch 3 of an epoch of 4 batches; this fit's "
        "epochs have 2. It drops the first 3 batches of its epoch 1 as trained already"
    )


# -- what a resumed fit prints --------------------------------------------------------------------


class _BatchesSeen(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches.append(batch)


def test_verbose_resume_says_where_fit_goes_on(tmp_path, mp, capsys, monkeypatch):
    inputs = _arrays(4)  # 4 batches per epoch

    def fit(epochs: int, directory=tmp_path, **kwargs: Any) -> tuple[list[str], list, list]:
        seen = _BatchesSeen()
        checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None, verbose=1, **kwargs)
        history = _mlp()().fit(
            **inputs(), epochs=epochs, shuffle=False, verbose=0, callbacks=[checkpoint, seen]
        )
        return capsys.readouterr().out.splitlines(), history.epoch, seen.batches

    # resume=True and nothing there (a new run, or a mistyped directory): said, named absolute.
    monkeypatch.chdir(tmp_path.parent)
    lines, _, _ = fit(1, tmp_path.name, save_freq=3, resume=True)  # step 3: epoch 0, batch 3
    assert lines == [
        f"Nothing to resume from: no committed step in '{tmp_path}', so fit starts fresh.",
        f"Epoch 1, batch 3: saving step 3 to '{tmp_path.name}'",
    ]

    lines, epochs, batches = fit(2, resume=True)
    assert lines == [
        f"Resuming from step 3 of '{tmp_path}' at epoch 1/2, batch 3: the input goes on from the "
        "position saved with the step, reading none of the batches trained before; other "
        "callbacks (the progress bar, loggers) still see their batch hooks run for them.",
        f"Epoch 1: saving step 4 to '{tmp_path}'",
        f"Epoch 2: saving step 8 to '{tmp_path}'",
    ]
    assert epochs == [0, 1]
    assert batches == [0, 1, 2, 3, 0, 1, 2, 3]  # as documented: the dropped 0-2 are seen too

    lines, epochs, _ = fit(3, resume=True)
    assert lines == [
        f"Resuming from step 8 of '{tmp_path}': 2 epochs done, fit goes on at epoch 3/3.",
        f"Epoch 3: saving step 12 to '{tmp_path}'",
    ]
    assert epochs == [2]

    lines, epochs, batches = fit(3, resume=True)
    assert lines == [
        f"Resuming from step 12 of '{tmp_path}' (3 epochs done): all 3 epochs are done, "
        "nothing left to train."
    ]
    assert epochs == [] and batches == []


class _LogsSeen(keras.callbacks.Callback):
    """Each batch's logs, and (in `events`) when `get_metrics_result` ran among the batches."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.logs: list[tuple[int, dict]] = []
        self.events = events

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.logs.append((batch, dict(logs or {})))
        self.events.append(("batch", batch))


def test_the_dropped_batches_report_the_logs_fit_reported_at_the_checkpoint(
    tmp_path, mp, monkeypatch
):
    """A resume mid-epoch: the batches trained before the checkpoint report the logs `fit`
    reported after the checkpoint's batch, saved with the step, and the metrics' results are
    not computed before the first batch trained (in a fresh process, that compiles their ops)."""
    inputs = _arrays(4)  # 4 batches per epoch
    events: list = []
    first = _LogsSeen(events)
    checkpoint = ModelCheckpoint(tmp_path, save_freq=3, max_to_keep=None)  # after batch 2
    _mlp()().fit(**inputs(), epochs=1, shuffle=False, verbose=0, callbacks=[first, checkpoint])
    saved_logs = dict(first.logs)[2]
    assert set(saved_logs) == {"loss", "mae"}

    computed = keras.Model.get_metrics_result

    def eager_calls_noted(self: keras.Model) -> dict:
        result = computed(self)
        if not any(isinstance(v, jax.core.Tracer) for v in result.values()):  # not in a train step
            events.append("computed")
        return result

    monkeypatch.setattr(keras.Model, "get_metrics_result", eager_calls_noted)
    events.clear()
    resumed = _LogsSeen(events)
    checkpoint = ModelCheckpoint(tmp_path, max_to_keep=None, resume=True)
    _mlp()().fit(**inputs(), epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint, resumed])
    assert checkpoint.restored is not None and checkpoint.restored.step == 3
    assert [logs for batch, logs in resumed.logs if batch < 3] == [saved_logs] * 3
    assert "computed" not in events[: events.index(("batch", 3))]
