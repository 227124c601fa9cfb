"""Worker for tests/test_export_h5.py: a model sharded over both processes' devices, written with
`keras_orbax.save_weights` by every process into one file; then a model whose walk raises part-way
on process 0, then on process 1; then one whose region process 1 staged is torn before process 0
copies it in; then a 64 MiB kernel written with a 1 MiB window, each process's peak RSS growth
measured (one launch for the six exports).

args: {"root": a directory holding `ok/`, `fail_0/`, `fail_1/`, `torn/` and `memory/`, each to
get `m.weights.h5`}
"""

import jax
import keras
import numpy as np

import keras_orbax
from tests import _models
from tests._rss import peak_growth
from tests._worker_util import init_worker, write_result


class FailsOn(keras.layers.Layer):
    """Stores its variable, then raises on process `process` only."""

    def __init__(self, process, **kwargs):
        super().__init__(**kwargs)
        self.process = process

    def build(self, input_shape):
        self.w = self.add_weight(shape=(8, 8), initializer="ones")

    def call(self, x):
        return x

    def save_own_variables(self, store):
        store["0"] = self.w
        if jax.process_index() == self.process:
            raise OSError(f"disk gone on process {self.process}")


def main() -> None:
    ctx = init_worker()
    keras.utils.set_random_seed(0)  # every process must initialize the same values
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    result = {}
    for name, fail_on in (("ok", None), ("fail_0", 0), ("fail_1", 1)):
        if fail_on is None:
            model = _models.compile_adam(_models.full_model())
            model.optimizer.build(model.trainable_variables)
            _models.fill_arange(model, limit=1000)
        else:
            inputs = keras.Input((16,))
            model = keras.Model(inputs, FailsOn(fail_on)(keras.layers.Dense(8)(inputs)))
        spans = any(not v.value.is_fully_addressable for v in model.weights)
        path = f"{ctx.args['root']}/{name}/m.weights.h5"
        try:
            keras_orbax.save_weights(model, path, window_bytes=64)
            error = None
        except Exception as failed:  # every process must raise; the test checks what
            error = f"{type(failed).__name__}: {failed}"
        result[name] = {"spans_processes": spans, "error": error}
    result["torn"] = _torn(f"{ctx.args['root']}/torn/m.weights.h5")
    result["memory"] = _memory(f"{ctx.args['root']}/memory")
    write_result(result)


def _torn(path: str) -> dict:
    """Process 1, once it has staged its regions and before it reports them, flips the last byte
    of its largest staged region (a torn write on the shared filesystem); process 0 copies it in,
    reads every dataset back against the CRCs each process reported, and both fail."""
    from pathlib import Path

    from keras_orbax._src.storage import commit

    staged = Path(path).with_name(".m.weights.h5.partial") / "regions" / "m.weights.h5"

    def tear(stage: str) -> None:
        if stage == "agree" and jax.process_index() == 1:
            largest = max(staged.iterdir(), key=lambda p: p.stat().st_size)
            with open(largest, "r+b") as f:
                f.seek(-1, 2)
                byte = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([byte[0] ^ 0x01]))

    model = _models.compile_adam(_models.full_model())
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model, limit=1000)
    try:
        with commit.on_stage(tear):
            keras_orbax.save_weights(model, path, window_bytes=64)
        return {"error": None}
    except Exception as failed:  # every process must raise; the test checks what
        return {"error": f"{type(failed).__name__}: {failed}"}


def _memory(directory: str) -> dict:
    """Peak RSS growth, in bytes, of this process while the 64 MiB kernel (32 MiB held here) is
    written with a 1 MiB window; and, to show the measure sees memory, while this process's part
    of it is copied to the host and kept."""
    inputs = keras.Input((2048,))
    model = keras.Model(inputs, keras.layers.Dense(8192, use_bias=False)(inputs))
    kernel = model.weights[0].value
    keras_orbax.save_weights(model, f"{directory}/warm.weights.h5", window_bytes=1 << 20)
    export = peak_growth(
        lambda: keras_orbax.save_weights(model, f"{directory}/m.weights.h5", window_bytes=1 << 20)
    )
    held = []
    copy = peak_growth(lambda: held.extend(np.array(s.data) for s in kernel.addressable_shards))
    return {"export": export, "host_copy": copy, "held": sum(h.nbytes for h in held)}


if __name__ == "__main__":
    main()
