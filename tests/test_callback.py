"""`keras_orbax.ModelCheckpoint` in real fits on 8 devices under ModelParallel."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax.errors import KerasOrbaxWarning
from tests import _models
from tests._beacons import Beacon
from tests._harness import REPO_ROOT, WORKERS_DIR, start_workers

BATCHES = 4  # per epoch: 32 samples, batch size 8


def _data(model: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    if model.name == "mlp":
        rng = np.random.default_rng(0)
        return rng.random((32, 16), dtype="float32"), rng.random((32, 8), dtype="float32")
    return _models.training_data()


def _fit(model: keras.Model, epochs: int, callbacks: list, **kwargs) -> keras.callbacks.History:
    x, y = _data(model)
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **kwargs
    )


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables)


def _assert_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _mlp() -> keras.Model:
    return _models.compile_adam(_models.mlp())


class _Scores(keras.callbacks.Callback):
    """Puts a scripted `score` for each epoch into the logs; list it before the checkpoint."""

    def __init__(self, scores: dict[int, float]) -> None:
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert logs is not None
        logs["score"] = self.scores[epoch]


@pytest.fixture
def mp(distribution):
    return distribution(_models.model_parallel((2, 4)))


# -- resume ---------------------------------------------------------------------------------------


def test_resumed_fit_ends_exactly_where_an_uninterrupted_fit_does(tmp_path, mp, capsys):
    keras.utils.set_random_seed(1)
    uninterrupted = _models.compile_adam(_models.full_model())  # with Dropout: seed state matters
    _fit(uninterrupted, 4, [])

    keras.utils.set_random_seed(1)
    first = _models.compile_adam(_models.full_model())
    _fit(first, 2, [keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, verbose=1)])
    assert step_dirs.committed_steps(tmp_path) == [4, 8]

    keras.utils.set_random_seed(2)  # a different init: the restore must overwrite all of it
    fresh = _models.compile_adam(_models.full_model())
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, resume=True, verbose=1)
    history = _fit(fresh, 4, [checkpoint])

    assert checkpoint.restored is not None and checkpoint.restored.step == 8
    assert history.epoch == [2, 3]
    assert step_dirs.committed_steps(tmp_path) == [4, 8, 12, 16]  # global steps: none collide
    assert int(fresh.optimizer.iterations) == 16
    _assert_equal(_state(fresh), _state(uninterrupted))
    lines = capsys.readouterr().out.splitlines()
    saves = [f"Epoch {e}: saving step {4 * e} to '{tmp_path}'" for e in (1, 2, 3, 4)]
    resuming = f"Resuming from step 8 of '{tmp_path}': 2 epochs done, fit goes on at epoch 3/4."
    assert lines == [*saves[:2], resuming, *saves[2:]]


def test_save_lines_start_their_own_line_under_a_progress_bar(tmp_path, capsys):
    model = _models.compile_adam(_models.full_model())
    x, y = _data(model)
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, verbose=1)
    model.fit(x, y, batch_size=8, epochs=2, verbose=1, callbacks=[checkpoint])
    out = capsys.readouterr().out
    # Keras's bar leaves its line open ("... loss: 0.35"): each save line begins a line of its own.
    for step in (4, 8):
        assert f"\nEpoch {step // 4}: saving step {step} to '{tmp_path}'\n" in out, out


def test_mid_epoch_async_saves_hold_their_step_and_resume_skips_the_batches_done(tmp_path, mp):
    keras.utils.set_random_seed(3)
    model = _models.compile_adam(_models.full_model())
    seen: dict[int, list[np.ndarray]] = {}

    def record(batch: int, logs: dict | None = None) -> None:
        model.jax_state_sync()
        seen[int(model.optimizer.iterations)] = _state(model)

    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=3, max_to_keep=None)
    _fit(model, 3, [checkpoint, keras.callbacks.LambdaCallback(on_train_batch_end=record)])

    assert step_dirs.committed_steps(tmp_path) == [3, 6, 9, 12]
    positions = {}
    for step in (3, 6, 9, 12):
        fresh = _models.compile_adam(_models.full_model())
        result = keras_orbax.restore_sharded(fresh, tmp_path, step)
        positions[step] = (result.record.epoch, result.record.batch)
        _assert_equal(_state(fresh), seen[step])  # training went on while it was written
    # (epochs done, batches done in the next one); step 12 ends epoch 2: "3 epochs done".
    assert positions == {3: (0, 3), 6: (1, 2), 9: (2, 1), 12: (3, None)}

    shutil.rmtree(tmp_path / "9")
    shutil.rmtree(tmp_path / "12")  # as if the process died after step 6 (epoch 1, batch 2)
    resumed = _models.compile_adam(_models.full_model())
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=3, max_to_keep=None, resume=True)
    history = _fit(resumed, 3, [checkpoint])
    assert history.epoch == [1, 2]  # epoch 1 goes on after its first 2 batches
    assert int(resumed.optimizer.iterations) == 12
    assert step_dirs.committed_steps(tmp_path) == [3, 6, 9, 12]
    _assert_equal(_state(resumed), seen[12])


# -- retention ------------------------------------------------------------------------------------


SCORES = {0: 0.2, 1: 0.9, 2: 0.1, 3: 0.7, 4: 0.8}


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({"max_to_keep": 2}, [16, 20]),
        ({"keep_best": 2}, [4, 12, 20]),  # best: 0.1 (step 12), 0.2 (step 4); and the latest
        ({"keep_every": 8}, [8, 16, 20]),
        ({"max_to_keep": 2, "keep_best": 1, "keep_every": 8}, [8, 12, 16, 20]),
        ({"max_to_keep": None, "keep_best": 1}, [4, 8, 12, 16, 20]),
    ],
)
def test_retention_keeps_exactly_the_steps_of_its_rules(tmp_path, mp, options, kept):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, monitor="score", mode="min", **options)
    _fit(_mlp(), 5, [_Scores(SCORES), checkpoint])
    assert step_dirs.committed_steps(tmp_path) == kept


def test_retention_across_a_restart_keeps_the_first_runs_best(tmp_path, mp):
    def checkpoint(**kwargs):
        return keras_orbax.ModelCheckpoint(
            tmp_path, monitor="score", mode="max", keep_best=1, keep_every=8, **kwargs
        )

    scores = {0: 0.9, 1: 0.1, 2: 0.5, 3: 0.4, 4: 0.7, 5: 0.3}
    _fit(_mlp(), 3, [_Scores(scores), checkpoint()])
    assert step_dirs.committed_steps(tmp_path) == [4, 8, 12]  # best, every 8th, latest

    _fit(_mlp(), 6, [_Scores(scores), checkpoint(resume=True)])
    assert step_dirs.committed_steps(tmp_path) == [4, 8, 16, 24]


def test_save_best_only_recovers_the_best_value_after_a_restart(tmp_path, mp):
    def checkpoint(**kwargs):
        return keras_orbax.ModelCheckpoint(
            tmp_path, monitor="score", mode="min", save_best_only=True, **kwargs
        )

    scores = {0: 0.5, 1: 0.1, 2: 0.3, 3: 0.2, 4: 0.4, 5: 0.05}
    _fit(_mlp(), 3, [_Scores(scores), checkpoint(max_to_keep=None)])
    assert step_dirs.committed_steps(tmp_path) == [4, 8]

    restarted = checkpoint(max_to_keep=None, resume=True)
    history = _fit(_mlp(), 6, [_Scores(scores), restarted])
    # Resumed at epoch 2, after step 8. Without the recovered best (0.1), epoch 2's 0.3 and
    # epoch 3's 0.2 would have been saved as new bests (steps 12 and 16).
    assert history.epoch == [2, 3, 4, 5]
    assert step_dirs.committed_steps(tmp_path) == [4, 8, 24]
    assert restarted.best == 0.05


def test_save_best_only_keeps_the_best_step_past_a_preemption_save(tmp_path, mp):
    checkpoint = keras_orbax.ModelCheckpoint(
        tmp_path, monitor="score", mode="min", save_best_only=True
    )

    def preempt(epoch: int, logs: dict | None = None) -> None:
        if epoch == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next batch end: step 13

    scores = {0: 0.5, 1: 0.1, 2: 0.3, 3: 0.2}
    history = _fit(
        _mlp(),
        4,
        [_Scores(scores), checkpoint, keras.callbacks.LambdaCallback(on_epoch_end=preempt)],
    )
    assert checkpoint.preempted and history.epoch == [0, 1, 2, 3]
    # The preemption save is the latest (to resume from) but not a "best": step 8 stays.
    assert step_dirs.committed_steps(tmp_path) == [8, 13]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# -- failures -------------------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    return {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": str(REPO_ROOT),
    }


@pytest.mark.parametrize("epochs", [2, 3], ids=["at_train_end", "at_the_next_save"])
def test_failed_background_save_raises_and_the_last_step_survives(tmp_path, mp, epochs):
    # The worker's writes fail for real (RLIMIT_FSIZE, set in that process only) after step 4.
    directory = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(WORKERS_DIR / "fsize_limited_fit.py"), str(directory), str(epochs),
         str(tmp_path)],
        env=_worker_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())

    assert result["error"] is not None and result["error"]["type"] == "SaveFailedError"
    message = result["error"]["message"]  # Keras's fit drops the chain: the message says it all
    assert re.search(r"step 8 .* in the background", message), message
    assert "File too large" in message
    assert message.endswith("The last committed step, 4, is intact.")
    assert result["sigterm_is_default"]  # cleaned up although fit raised
    assert result["gc_enabled"]  # the failed save resumed the collector it had paused
    assert step_dirs.committed_steps(directory) == [4]
    fresh = _models.compile_adam(_models.mlp(width=16384))
    assert keras_orbax.restore_sharded(fresh, directory).step == 4
    with np.load(tmp_path / "after_first.npz") as after_first:
        _assert_equal(_state(fresh), [after_first[f"arr_{i}"] for i in range(len(after_first))])


def test_preempted_training_saves_its_step_exits_cleanly_and_resumes(tmp_path, mp):
    from tests.workers import preempt_train

    directory, result = tmp_path / "ckpt", tmp_path / "result.json"
    env = _worker_env()
    script = WORKERS_DIR / "preempt_train.py"
    log = tmp_path / "worker.log"
    with (
        Beacon(tmp_path / "ready") as ready,
        log.open("wb") as out,
        subprocess.Popen(
            [sys.executable, str(script), str(directory), str(ready), str(result)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as proc,
    ):
        try:
            ready.wait(proc, timeout=300, log=log)  # epoch 1, batch 3
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]

    # It stopped at the batch end right after the signal: step 12, batch 4 of epoch 1.
    assert json.loads(result.read_text()) == {"preempted": True, "step": 12, "epochs": [0, 1]}
    assert step_dirs.committed_steps(directory) == [8, 12]
    record = step_dirs.read_record(directory / "12")
    preempted = {"reason": "preemption", "steps_per_epoch": 8}
    assert (record.epoch, record.batch, record.extra) == (1, 4, preempted)

    model = preempt_train.build()
    checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None, resume=True)
    x, y = preempt_train.data()
    history = model.fit(
        x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[checkpoint]
    )
    assert checkpoint.restored is not None and checkpoint.restored.step == 12
    assert history.epoch == [1, 2]  # epoch 1 goes on after its first 4 batches
    assert int(model.optimizer.iterations) == 3 * preempt_train.BATCHES_PER_EPOCH
    assert step_dirs.committed_steps(directory) == [8, 12, 16, 24]


# -- arguments and misuse -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"save_freq": "batch"},
            r"save_freq must be 'epoch' or a positive int\. Received: save_freq='batch'",
        ),
        ({"save_freq": 0}, r"Received: save_freq=0"),
        (
            {"max_to_keep": 0},
            r"max_to_keep must be None or a positive int\. Received: max_to_keep=0",
        ),
        ({"keep_best": -1}, r"Received: keep_best=-1"),
        ({"keep_every": 2.5}, r"Received: keep_every=2\.5"),
        ({"format": "zip"}, r"Received: format='zip'"),
        (
            {"resume": True, "save_weights_only": True},
            r"Received: resume=True, save_weights_only=True",
        ),
    ],
)
def test_bad_arguments_are_refused_with_keras_manners(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_orbax.ModelCheckpoint(tmp_path, **kwargs)


def test_a_directory_ahead_of_the_model_is_refused_without_resume(tmp_path, mp):
    _fit(_mlp(), 2, [keras_orbax.ModelCheckpoint(tmp_path)])
    with pytest.raises(
        ValueError, match=r"already holds steps up to 8, but the model is at step 0"
    ):
        _fit(_mlp(), 1, [keras_orbax.ModelCheckpoint(tmp_path)])


def test_weights_only_checkpoints_hold_no_optimizer_state(tmp_path, mp):
    model = _mlp()
    _fit(model, 1, [keras_orbax.ModelCheckpoint(tmp_path, save_weights_only=True)])
    record = step_dirs.read_record(tmp_path / "4")
    assert len(record.variables) == 4  # two kernels, two biases
    assert all(v.role == "model" for v in record.variables.values())
    bare = _models.mlp()
    keras_orbax.restore_sharded(bare, tmp_path)
    _assert_equal(_models.values(bare.variables), _models.values(model.variables))


def test_processes_agree_on_best_saves_and_on_the_preemption_step(tmp_path):
    with Beacon(tmp_path / "ready") as ready:
        args = {"directory": str(tmp_path / "ckpt"), "ready": str(ready)}
        with start_workers(WORKERS_DIR / "callback_multiprocess.py", 2, 4, args) as workers:
            ready.wait(workers.procs, timeout=240, log=workers.log_path(0))
            workers.kill(1, signal.SIGTERM)  # a preemption notice to one process only
            results = workers.wait(timeout=240)

    for result in results:
        assert result["process_count"] == 2
        # Process 0's decisions (its scores improve at epochs 0, 1, 3), whatever process 1 saw.
        assert result["best_steps"] == [4, 8, 16]
        assert result["preempted"]
        # Of the hundreds set for the saves, the restores and the preemption, only those of
        # the last two collective calls, and of the last save's write agreement, may be left
        # (each process deletes its own one round later): at most 2 keys each.
        left = result["keys_left"]
        agreements = [k for k in left if k.startswith("keras_orbax/outcome/")]
        assert len(agreements) <= 2 and len(left) - len(agreements) <= 4, left
        # Step 16's array file failed its checksum on some process: all fell back to step 8.
        assert result["resumed_step"] == 8
        assert result["best_after"] == [4, 8]
        assert result["aside"] == ["16.unreadable"]
    assert results[0]["best"] == 0.3
    # Both saved the same step, the one JAX's preemption service agreed on, and stopped there.
    step = results[0]["step"]
    assert results[1]["step"] == step
    assert step > results[0]["start_step"] + 6
    assert results[0]["preempt_steps"] == results[1]["preempt_steps"]
    assert results[0]["preempt_steps"][-1] == step


class _Logs(keras.callbacks.Callback):
    """Logs `name` at each epoch's end with the next of `values`, as a NumPy float32 (what a
    user's callback logging `np.mean(...)` puts there)."""

    def __init__(self, name: str, values: list[float]) -> None:
        super().__init__()
        self.name, self.values = name, iter(values)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs[self.name] = np.float32(next(self.values))


def test_a_numpy_scalar_monitor_is_a_number(tmp_path, recwarn):
    """Keras's callbacks take a NumPy scalar in the logs as a number; so do save_best_only and the
    metrics stored with each step."""
    model = _models.compile_adam(_models.mlp())
    callback = keras_orbax.ModelCheckpoint(
        tmp_path, monitor="custom", mode="min", save_best_only=True, max_to_keep=3
    )
    _fit(model, 3, [_Logs("custom", [3.0, 1.0, 2.0]), callback])
    assert step_dirs.committed_steps(tmp_path) == [BATCHES, 2 * BATCHES]  # 3.0, then 1.0
    summaries = keras_orbax.inspect(tmp_path).summaries
    assert [s.metrics["custom"] for s in summaries] == [3.0, 1.0]
    assert not [w for w in recwarn if "not a number" in str(w.message)]


def test_keep_best_on_a_monitor_a_batch_does_not_log_warns_once(tmp_path):
    model = _models.compile_adam(_models.mlp())
    x, y = _data(model)
    callback = keras_orbax.ModelCheckpoint(tmp_path, keep_best=1, save_freq=2)  # val_loss
    with pytest.warns(KerasOrbaxWarning) as warned:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
                  callbacks=[callback])  # fmt: skip
    messages = [str(w.message) for w in warned if "cannot rank" in str(w.message)]
    assert messages == [
        "ModelCheckpoint(keep_best=1) cannot rank the steps it saves (only max_to_keep and "
        "keep_every keep them) while 'val_loss' is not a number in the logs after a batch "
        "(save_freq=2). Received: val_loss=None"
    ]


def test_a_preemption_save_ranks_kept_steps_in_the_monitor_direction(tmp_path):
    """keep_best with mode="max": a resumed fit preempted before any ordinary save still keeps
    the best step (its retention had ranked with lower-is-better, and deleted it)."""

    def checkpoint(**kwargs) -> keras_orbax.ModelCheckpoint:
        return keras_orbax.ModelCheckpoint(
            tmp_path, monitor="score", mode="max", keep_best=1, max_to_keep=1, **kwargs
        )

    _fit(_models.compile_adam(_models.mlp()), 3, [_Logs("score", [0.9, 0.1, 0.2]), checkpoint()])
    best, latest = BATCHES, 3 * BATCHES
    assert step_dirs.committed_steps(tmp_path) == [best, latest]

    class _Preempt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    resumed = checkpoint(resume=True)
    _fit(_models.compile_adam(_models.mlp()), 6, [_Preempt(), _Logs("score", [0.0] * 6), resumed])
    assert resumed.preempted
    assert step_dirs.committed_steps(tmp_path) == [best, latest + 1]
