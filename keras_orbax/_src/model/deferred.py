"""Building models and optimizers without allocating their variables."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax.errors import DeferredVariableError, NotDeferrableError

_state = threading.local()


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Builds models and optimizers inside without allocating any variable.

    Every variable made from an initializer inside keeps only its shape, dtype and layout (taken
    from the active `keras.distribution` when it is created, so optimizer slots inherit it).
    `restore_sharded` then creates each value straight from the checkpoint's shards on the devices
    that own them: peak memory is one sharded copy of the model. Using a deferred variable before
    it is restored raises `DeferredVariableError` instead of silently initializing it.

    Compile after the block, or pass an optimizer object made before it: Keras makes an optimizer's
    step counter from a number, which it cannot defer. The optimizer's slots are built, deferred and
    sharded like their variables, by `restore_sharded`. For a subclassed model, build it inside with a
    symbolic call, `model(keras.Input(shape))`.

    Raises:
        NotDeferrableError: a variable made from a number was created inside (e.g. by `compile`).

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    with keras_orbax.deferred_init():
        model = build_model()
    model.compile(optimizer="adam", loss="mse")
    keras_orbax.restore_sharded(model, "/ckpt")
    ```
    """
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"keras-orbax needs the JAX backend. Received: backend={keras.backend.backend()}"
        )
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        with keras_compat.deferred_scope(_prepare):
            yield
    except ValueError as error:
        if "while in a stateless scope" not in str(error):
            raise
        raise NotDeferrableError(
            "A variable that Keras cannot defer (made from a number, not an initializer) was "
            "created inside keras_orbax.deferred_init(). This is usually `model.compile(optimizer="
            "'adam')`, whose optimizer makes its step counter from 0: compile after the "
            "`with` block, or create the optimizer before it and pass the object. A keras-hub "
            "task compiles a default optimizer when it is made: pass it compile=False, and "
            "compile after the block."
        ) from error
    finally:
        _state.depth = depth


def is_deferred(variable: keras.Variable) -> bool:
    """True for a variable made under `deferred_init()` that holds no value yet."""
    return not keras_compat.is_allocated(variable)


def initialize(variable: keras.Variable) -> None:
    """Initializes a deferred variable with its own initializer, sharded by its layout."""
    original = keras_compat.initializer(variable)
    if isinstance(original, _Guarded):
        keras_compat.set_initializer(variable, original.initializer)
    keras_compat.initialize_deferred(variable)


def build_optimizer(model: keras.Model) -> None:
    """Builds `model.optimizer` for its trainable variables, without allocating the slots if the
    model itself is deferred and the optimizer allows it (see `deferred_copy`)."""
    variables = model.trainable_variables
    if any(is_deferred(v) for v in variables) and _defers(model.optimizer, variables):
        with deferred_init():
            model.optimizer.build(variables)
    else:
        model.optimizer.build(variables)


def deferred_copy(
    optimizer: keras.optimizers.Optimizer, variables: list[keras.Variable]
) -> keras.optimizers.Optimizer:
    """A copy of an unbuilt `optimizer`, built for `variables`: what building the real one would
    create (shapes, dtypes, layouts, order), leaving the real one as it is.

    Its slots are deferred (nothing allocated), except for optimizers whose `build` makes a
    variable from a number (`Nadam`'s `_u_product`, `Adafactor`'s placeholders), which Keras cannot
    defer: those are built normally, as their real build will be.
    """
    copy = type(optimizer).from_config(optimizer.get_config())
    try:
        with deferred_init():
            copy.build(variables)
    except NotDeferrableError:
        copy = type(optimizer).from_config(optimizer.get_config())
        copy.build(variables)
    return copy


def optimizer_stand_in(model: keras.Model, saved: int) -> keras.optimizers.Optimizer | None:
    """A deferred copy of `model.optimizer`, built, if it is not built yet and the saved state
    holds `saved` optimizer variables, more than it has before `build` (its step counter...): the
    copy's variables have the shapes, layouts and keys the real ones will get, and allocate
    nothing. Keras's `load_model` likewise builds the optimizer before loading, so that it takes
    the saved state."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return None
    if saved <= len(optimizer.variables):
        return None
    return deferred_copy(optimizer, model.trainable_variables)


def _defers(optimizer: keras.optimizers.Optimizer, variables: list[keras.Variable]) -> bool:
    """Whether `optimizer.build` can run inside `deferred_init()` (tried on a copy: a failed build
    would leave the real optimizer half-built)."""
    return any(is_deferred(v) for v in deferred_copy(optimizer, variables).variables)


def _prepare(variable: keras.Variable) -> None:
    """Runs as each deferred variable is created: fixes its layout, guards its initializer."""
    distribution = keras.distribution.distribution()
    if keras_compat.layout(variable) is None and distribution is not None:
        keras_compat.set_layout(variable, distribution.get_variable_layout(variable))
    initializer = keras_compat.initializer(variable)
    if not isinstance(initializer, _Guarded):
        keras_compat.set_initializer(variable, _Guarded(initializer, variable.path))


class _Guarded:
    """A deferred variable's initializer that runs only for shape inference inside `deferred_init()`."""

    def __init__(self, initializer: Any, path: str) -> None:
        self.initializer = initializer
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "depth", 0) == 0:
            raise DeferredVariableError(
                f"Variable '{self.path}' was built under keras_orbax.deferred_init() and has no "
                "value yet. Call keras_orbax.restore_sharded(model, directory) before using the "
                "model (with strict=False, variables the checkpoint lacks are initialized)."
            )
        return self.initializer(*args, **kwargs)
