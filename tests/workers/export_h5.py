"""Worker for tests/test_export_h5.py: a model sharded over both processes' devices, written with
`keras_orbax.save_weights` by every process into one file.

args: {"path": the .weights.h5 to write}
"""

import keras

import keras_orbax
from tests import _models
from tests._worker_util import init_worker, write_result


def main() -> None:
    ctx = init_worker()
    keras.utils.set_random_seed(0)  # every process must initialize the same values
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.full_model())
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model, limit=1000)
    spans = any(not v.value.is_fully_addressable for v in model.weights)
    keras_orbax.save_weights(model, ctx.args["path"], window_bytes=64)
    write_result({"spans_processes": spans})


if __name__ == "__main__":
    main()
