"""A training run that may be SIGKILLed anywhere; started by `tests/_kill.py` (not by `_harness`).

One process, 8 virtual CPU devices, ModelParallel (2, 4). Arguments: one JSON object in argv[1]:
directory, ledger, result, mode ("async" or "sync"), format, seed, epochs (how many more to run),
kill ("none", or "<event>:<n>": SIGKILL itself just before the n-th such event; events are
"delete" (a file removed from a committed step: retention), "commit" (a rename of a temporary
checkpoint path: the commit) and "write" (a Python-level file opened for writing under the
directory: Orbax's metadata)), started_fd (None, or a pipe's write end, inherited: one byte is
written there when `fit` begins, for a driver that kills at a time from then on).

Before training, it checks what the previous run left: every committed step is restored into a
fresh model and its checksum compared with the ledger. The ledger holds, for each global step, a
checksum of every model and optimizer value at that step, written (fsynced) before a save of that
step starts; later lines win (a resumed run recomputes the steps after the one it restored). The
check is written to `result` before `fit` starts, so a kill later loses nothing of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

args = json.loads(sys.argv[1])
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_orbax  # noqa: E402
from keras_orbax._src.format import step_dirs  # noqa: E402
from tests import _models  # noqa: E402

DIRECTORY = Path(args["directory"])
LEDGER = Path(args["ledger"])
SAVE_FREQ = 2  # batches; 4 batches per epoch
TMP = ".orbax-checkpoint-tmp"


def checksum(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for variable in model.variables + model.optimizer.variables:
        digest.update(np.ascontiguousarray(np.asarray(variable.value)).tobytes())
    return digest.hexdigest()


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = _models.compile_adam(_models.full_model())  # with Dropout: seed state is saved too
    model.optimizer.build(model.trainable_variables)
    return model


def read_ledger() -> dict[int, str]:
    entries: dict[int, str] = {}
    if LEDGER.exists():
        for line in LEDGER.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
                entries[int(parts[0])] = parts[1]
    return entries


def check_previous_run() -> dict:
    """Restores every committed step and compares it with the ledger."""
    steps = step_dirs.committed_steps(DIRECTORY)
    ledger = read_ledger()
    checked = {}
    for step in steps:
        model = build(seed=1000 + step)  # another init: the restore must overwrite all of it
        try:
            keras_orbax.restore_sharded(model, DIRECTORY, step)
        except keras_orbax.errors.KerasOrbaxError as error:
            checked[step] = f"error: {type(error).__name__}: {str(error)[:300]}"
            continue
        if step not in ledger:
            checked[step] = "no ledger entry"
        else:
            checked[step] = "ok" if checksum(model) == ledger[step] else "MISMATCH"
    leftovers = sorted(p.name for p in DIRECTORY.iterdir() if TMP in p.name) if steps else []
    return {"steps": steps, "checked": {str(k): v for k, v in checked.items()}, "tmp": leftovers}


class Ledger(keras.callbacks.Callback):
    """Listed before the checkpoint callback: the line for a step is on disk before its save."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.model.jax_state_sync()
        line = f"{int(self.model.optimizer.iterations)} {checksum(self.model)}\n"
        fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


class ResumeCheck(keras.callbacks.Callback):
    """Listed after the checkpoint callback: what `resume=True` restored matches the ledger."""

    def __init__(self, checkpoint: keras_orbax.ModelCheckpoint, result: dict) -> None:
        super().__init__()
        self.checkpoint, self.result = checkpoint, result

    def on_train_begin(self, logs: dict | None = None) -> None:
        restored = self.checkpoint.restored
        if restored is not None:
            ok = checksum(self.model) == read_ledger().get(restored.step)
            self.result["resumed"] = {"step": restored.step, "ok": ok}
        write_result(self.result)
        if args.get("started_fd") is not None:  # the driver may kill from now on
            os.write(args["started_fd"], b"s")
            os.close(args["started_fd"])


def write_result(result: dict) -> None:
    tmp = Path(args["result"] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args["result"])


def arm_kill(spec: str) -> None:
    """SIGKILLs this process just before the n-th event of a kind (see the module docstring)."""
    if spec == "none":
        return
    kind, n = spec.split(":")
    remaining = [int(n)]
    root = str(DIRECTORY)

    def matches(event: str, hook_args: tuple) -> bool:
        if kind == "delete" and event in ("os.remove", "os.rmdir"):
            path, dir_fd = str(hook_args[0]), hook_args[1]
            # shutil.rmtree (Orbax's deleter on few cores) unlinks names relative to a dir_fd
            return (path.startswith(root) and TMP not in path) or dir_fd not in (None, -1)
        if kind == "commit" and event == "os.rename":
            return str(hook_args[0]).startswith(root) and TMP in str(hook_args[0])
        if kind == "write" and event == "open":
            path, mode = str(hook_args[0]), hook_args[1]
            return path.startswith(root) and isinstance(mode, str) and ("w" in mode or "a" in mode)
        return False

    def hook(event: str, hook_args: tuple) -> None:
        if remaining[0] > 0 and matches(event, hook_args):
            remaining[0] -= 1
            if remaining[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def main() -> None:
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    result = {"previous": check_previous_run()}
    write_result(result)
    model = build(seed=args["seed"])
    start = 0
    if step_dirs.committed_steps(DIRECTORY):
        start = keras_orbax.inspect(DIRECTORY).record.epoch or 0
    checkpoint = keras_orbax.ModelCheckpoint(
        DIRECTORY,
        save_freq=SAVE_FREQ,
        max_to_keep=2,
        resume=True,
        save_on_background=args["mode"] == "async",
        format=args["format"],
    )
    x, y = _models.training_data()
    arm_kill(args["kill"])
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=start + args["epochs"],
        shuffle=False,
        verbose=0,
        callbacks=[Ledger(), checkpoint, ResumeCheck(checkpoint, result)],
    )
    result["finished"] = {"step": int(model.optimizer.iterations)}
    write_result(result)


main()
