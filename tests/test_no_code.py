"""Nothing in a load path executes code from a checkpoint: no pickle, no marshal; `safe_mode`
refuses `Lambda` layers wherever a config is read.

`LOAD_PATHS` and `CONFIG_READERS` are lists on purpose: a new source format (`.weights.h5`,
`.keras`, keras-hub presets, safetensors) adds one entry with the function that writes it and the
function that loads it.
"""

from __future__ import annotations

import contextlib
import marshal
import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_orbax
from tests import _models

_GUARD = {"on": False, "calls": []}


def _audit(event: str, args: tuple) -> None:
    """Also catches unpicklers the patched names below miss (`_pickle.Unpickler`, `np.load`)."""
    if _GUARD["on"] and event in ("pickle.find_class", "marshal.loads", "marshal.load"):
        if event.startswith("marshal") and _from_importlib():
            return  # the interpreter importing a module from its own .pyc files
        _GUARD["calls"].append(event)
        raise RuntimeError(f"a load path called {event}")


sys.addaudithook(_audit)  # cannot be removed; inert while _GUARD["on"] is False


def _from_importlib() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def no_code_execution(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Makes `pickle.loads`, `pickle.load` and `marshal.loads` raise (except for imports); yields
    the list of attempts, which a load path must leave empty."""

    def refuse(name: str, original: Callable) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if name.startswith("marshal") and _from_importlib():
                return original(*args, **kwargs)
            _GUARD["calls"].append(name)
            raise RuntimeError(f"a load path called {name}")

        return guarded

    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads", pickle.loads))
    monkeypatch.setattr(pickle, "load", refuse("pickle.load", pickle.load))
    monkeypatch.setattr(marshal, "loads", refuse("marshal.loads", marshal.loads))
    _GUARD["calls"] = []
    _GUARD["on"] = True
    try:
        with pytest.raises(RuntimeError, match="called pickle"):
            pickle.loads(pickle.dumps(object()))  # the guard is really on
        _GUARD["calls"].clear()
        yield _GUARD["calls"]
    finally:
        _GUARD["on"] = False
        monkeypatch.undo()


# -- every load path ------------------------------------------------------------------------------


def _save_fast(model: keras.Model, directory: Path) -> None:
    keras_orbax.save(model, directory, step=1)


def _save_compact(model: keras.Model, directory: Path) -> None:
    keras_orbax.save(model, directory, step=1, format="compact")


def _restore(directory: Path) -> keras.Model:
    model = _models.compile_adam(_models.mlp())
    keras_orbax.restore_sharded(model, directory)
    return model


def _restore_deferred(directory: Path) -> keras.Model:
    with keras_orbax.deferred_init():
        model = _models.mlp()
    keras_orbax.restore_sharded(model, directory, strict=False)
    return model


class _Restored(Exception):
    """Raised once `resume=True` has restored, to look at the model before it trains."""


def _resume(directory: Path) -> keras.Model:
    model = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(directory, resume=True, max_to_keep=None)

    def stop(logs: dict | None = None) -> None:
        raise _Restored

    callbacks = [checkpoint, keras.callbacks.LambdaCallback(on_train_begin=stop)]
    with pytest.raises(_Restored):
        model.fit(np.ones((8, 16)), np.ones((8, 8)), epochs=1, verbose=0, callbacks=callbacks)
    assert checkpoint.restored is not None and checkpoint.restored.step == 1
    return model


def _save_h5(model: keras.Model, directory: Path) -> None:
    directory.mkdir()
    model.save_weights(directory / "m.weights.h5")
    model.save_weights(directory / "m.weights.json", max_shard_size=0.000004)


def _save_keras(model: keras.Model, directory: Path) -> None:
    directory.mkdir()
    model.save(directory / "m.keras")


LOAD_PATHS: list[tuple[str, Callable[[keras.Model, Path], None], Callable[[Path], keras.Model]]] = [
    ("restore_sharded-fast", _save_fast, _restore),
    ("restore_sharded-compact", _save_compact, _restore),
    ("restore_sharded-deferred", _save_fast, _restore_deferred),
    ("load_model-fast", _save_fast, keras_orbax.load_model),
    ("load_model-compact", _save_compact, keras_orbax.load_model),
    ("ModelCheckpoint-resume", _save_fast, _resume),
    ("inspect", _save_fast, lambda d: (keras_orbax.inspect(d), _restore(d))[1]),
    ("restore_sharded-weights.h5", _save_h5, lambda d: _restore(d / "m.weights.h5")),
    ("restore_sharded-weights.json", _save_h5, lambda d: _restore(d / "m.weights.json")),
    ("restore_sharded-keras", _save_keras, lambda d: _restore(d / "m.keras")),
    ("load_model-keras", _save_keras, lambda d: keras_orbax.load_model(d / "m.keras")),
]


@pytest.mark.parametrize(
    ("write", "load"), [p[1:] for p in LOAD_PATHS], ids=[p[0] for p in LOAD_PATHS]
)
def test_load_paths_work_without_pickle_or_marshal(
    tmp_path, distribution, monkeypatch, write, load
):
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model)
    model.optimizer.iterations.assign(1)  # the step it is saved as, so a resume may continue it
    write(model, tmp_path / "ckpt")
    with no_code_execution(monkeypatch) as calls:
        loaded = load(tmp_path / "ckpt")
    assert calls == []
    for name in ("hidden", "head"):
        for got, want in zip(
            loaded.get_layer(name).weights, model.get_layer(name).weights, strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


# -- safe_mode -------------------------------------------------------------------------------------


def _lambda_model() -> keras.Model:
    inputs = keras.Input((16,))
    x = keras.layers.Dense(8, name="dense")(inputs)
    outputs = keras.layers.Lambda(lambda t: t * 2.0, name="double")(x)
    return keras.Model(inputs, outputs, name="with_lambda")


CONFIG_READERS: list[tuple[str, Callable[..., keras.Model]]] = [
    ("load_model", keras_orbax.load_model),
]


@pytest.mark.parametrize("read", [r[1] for r in CONFIG_READERS], ids=[r[0] for r in CONFIG_READERS])
def test_safe_mode_refuses_lambda_layers(tmp_path, monkeypatch, read):
    model = _lambda_model()
    keras_orbax.save(model, tmp_path, step=1)
    with no_code_execution(monkeypatch) as calls:
        with pytest.raises(ValueError, match=r"(?i)lambda.*safe_mode"):
            read(tmp_path)
        assert calls == []
        with pytest.raises(ValueError, match=r"(?i)lambda.*safe_mode"):
            read(tmp_path, safe_mode=True)
        assert calls == []
    # The refusal is safe_mode's doing: with it off, the same checkpoint loads (and runs marshal).
    loaded = read(tmp_path, safe_mode=False)
    x = np.ones((2, 16), "float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_load_model_of_a_model_never_compiled(tmp_path):
    """Keras serializes an uncompiled model's compile_config as {}: nothing to compile, so the
    checkpoint's missing optimizer state is no mismatch."""
    model = _models.mlp()
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=1)
    loaded = keras_orbax.load_model(tmp_path)
    assert getattr(loaded, "optimizer", None) is None
    for got, want in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
