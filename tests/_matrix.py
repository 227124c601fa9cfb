"""The training setups users have, as small cases: every built-in optimizer, every precision policy,
gradient accumulation, quantized and LoRA layers. Shared by tests/test_training_matrix.py and its
fresh-process worker (tests/workers/matrix_resume.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import keras
import numpy as np

import keras_orbax

BATCHES_BEFORE, BATCHES_AFTER = 3, 3


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    optimizer: Callable[[], keras.optimizers.Optimizer]
    policy: str = "float32"
    quantize: str | None = None  # a `model.quantize` mode
    lora_rank: int | None = None

    @property
    def can_defer(self) -> bool:
        # `model.quantize` reads kernel values: a quantized model is restored into a normal build.
        return self.quantize is None


def _adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(1e-2)


CASES = [
    Case("sgd_momentum", lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True)),
    Case("adam", _adam),
    Case("adamw", lambda: keras.optimizers.AdamW(1e-2, amsgrad=True)),
    Case("adamax", lambda: keras.optimizers.Adamax(1e-2)),
    Case("adagrad", lambda: keras.optimizers.Adagrad(1e-2)),
    Case("adadelta", lambda: keras.optimizers.Adadelta(1.0)),
    Case("rmsprop", lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5, centered=True)),
    Case("nadam", lambda: keras.optimizers.Nadam(1e-2)),
    Case("ftrl", lambda: keras.optimizers.Ftrl(1e-2, l1_regularization_strength=0.01)),
    Case("lion", lambda: keras.optimizers.Lion(1e-3)),
    Case("lamb", lambda: keras.optimizers.Lamb(1e-2)),
    Case("adafactor", lambda: keras.optimizers.Adafactor(1e-2)),
    Case("muon", lambda: keras.optimizers.Muon(1e-2)),
    Case("schedule_free_adamw", lambda: keras.optimizers.ScheduleFreeAdamW(1e-2)),
    Case("loss_scale", lambda: keras.optimizers.LossScaleOptimizer(_adam())),
    Case("ema", lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=2)),
    Case(
        "gradient_accumulation", lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)
    ),
    Case("mixed_float16", _adam, policy="mixed_float16"),
    Case("mixed_bfloat16", _adam, policy="mixed_bfloat16"),
    Case("bfloat16", _adam, policy="bfloat16"),
    Case("int8", _adam, quantize="int8"),
    Case("int4", _adam, quantize="int4"),
    Case("float8", _adam, quantize="float8"),
    Case("lora", _adam, lora_rank=2),
]
BY_NAME = {case.name: case for case in CASES}


def distribution(shape: tuple[int, int]) -> keras.distribution.ModelParallel:
    """Kernels sharded over a (batch, model) mesh. Anchored to the layer names: Adafactor names
    its factored slots after the variable (`adafactor/kernel`), which `.*kernel` would also match."""
    import jax

    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["(hidden|middle|head)/kernel"] = ("batch", "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build(case: Case, *, deferred: bool = False) -> keras.Model:
    """The case's model, compiled (optimizer not built), under the case's policy; call inside
    `policy(case.policy)`. Deferred: built under `keras_orbax.deferred_init()`."""
    with keras_orbax.deferred_init() if deferred else contextlib.nullcontext():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(32, name="hidden")(inputs)
        x = keras.layers.Dense(16, name="middle", activation="relu")(x)
        outputs = keras.layers.Dense(8, name="head")(x)
        model = keras.Model(inputs, outputs, name=f"matrix_{case.name}")
        if case.lora_rank:
            model.get_layer("hidden").enable_lora(case.lora_rank)
            model.get_layer("middle").enable_lora(case.lora_rank)
    if case.quantize:
        model.quantize(case.quantize)
    model.compile(optimizer=case.optimizer(), loss="mse")
    return model


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [
        (rng.random((8, 16), dtype="float32"), rng.random((8, 8), dtype="float32"))
        for _ in range(BATCHES_BEFORE + BATCHES_AFTER)
    ]


def train(model: keras.Model, data: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for x, y in data:
        model.train_on_batch(x, y)


def state(model: keras.Model) -> list[np.ndarray]:
    """Every variable of the model and its optimizer, as stored (float16/bfloat16 viewed as bits)."""
    values = []
    for variable in model.variables + model.optimizer.variables:
        value = np.asarray(keras.ops.convert_to_numpy(variable.value))
        values.append(
            value.view(f"uint{value.dtype.itemsize * 8}") if value.dtype.kind == "V" else value
        )
    return values
