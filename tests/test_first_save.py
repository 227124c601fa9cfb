"""The first save of a process does no first-time work on the training loop's thread.

Checked in a fresh Python process (this one has serialized Keras objects and opened checkpointers
already): an import hook records where Keras looks for TensorFlow (its first serialization does, and
imports it where installed: seconds), a wrapper around `step_sink.open_checkpointer` records where
an Orbax Checkpointer is built, each with the callback hook running at the time and the thread. No
timings are asserted (benchmarks/first_save.py has the figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from keras_orbax._src.format import step_dirs
from tests._harness import REPO_ROOT

_SCRIPT = """
import json, sys, threading

import keras
import numpy as np

import keras_orbax
from keras_orbax._src.write import step_sink

hook = ["before fit"]
events = []


class LookForTensorFlow:  # finds nothing: the import goes on as it would
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow":
            events.append(["tensorflow looked for", hook[0], threading.current_thread().name])
        return None


sys.meta_path.insert(0, LookForTensorFlow())
real_open = step_sink.open_checkpointer


def recording_open(*args, **kwargs):
    events.append(["checkpointer built", hook[0], threading.current_thread().name])
    return real_open(*args, **kwargs)


step_sink.open_checkpointer = recording_open


class Hooked(keras_orbax.ModelCheckpoint):
    def on_train_begin(self, logs=None):
        hook[0] = "on_train_begin"
        super().on_train_begin(logs)
        hook[0] = "training"

    def on_epoch_end(self, epoch, logs=None):
        hook[0] = f"on_epoch_end {epoch}"
        super().on_epoch_end(epoch, logs)
        hook[0] = "training"


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
model.compile(optimizer="adam", loss="mse")
x = np.ones((8, 4), "float32")
model.fit(x, x, batch_size=4, epochs=2, verbose=0, callbacks=[Hooked(sys.argv[1])])
print(json.dumps(events))
"""


def test_the_first_save_finds_keras_and_orbax_warm(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(directory)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    events = [tuple(event) for event in json.loads(done.stdout.strip().splitlines()[-1])]

    assert step_dirs.committed_steps(directory) == [4]  # both saves ran (max_to_keep=1)
    # Keras looked for TensorFlow once, in on_train_begin, on the loop's thread: not in a save.
    assert events == [
        ("checkpointer built", "on_train_begin", "MainThread"),
        ("tensorflow looked for", "on_train_begin", "MainThread"),
    ]
