"""Worker for tests/test_export_h5.py: a model sharded over both processes' devices, written with
`keras_orbax.save_weights` by every process into one file; then a model whose walk raises part-way
on process 0, then on process 1 (one launch for the three exports).

args: {"root": a directory holding `ok/`, `fail_0/` and `fail_1/`, each to get `m.weights.h5`}
"""

import jax
import keras

import keras_orbax
from tests import _models
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
    write_result(result)


if __name__ == "__main__":
    main()
