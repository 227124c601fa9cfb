"""Private Keras and JAX symbols that `sources/keras_loader` needs to run Keras's own loading walk
on placeholders instead of data (the other Keras ones are in `keras_compat`). Each says why no
public API serves.

Tested with keras 3.15.1 and jax 0.10.2 (`versions.SUPPORTED`): the Keras symbols are resolved
on import, the JAX ones on first use, each failing with one `UnsupportedVersionError` if moved;
tests/test_keras_files.py runs every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_orbax._src.compat.versions import Private

_SAVING = "keras.src.saving.saving_lib"
_H5IOStore: Any = Private("keras", _SAVING, "H5IOStore").get()
_load_state: Callable[..., Any] = Private("keras", _SAVING, "_load_state").get()
_get_attr_skipset: Callable[[str], Any] = Private("keras", _SAVING, "get_attr_skipset").get()
_STATE = "keras.src.backend.common.global_state"
_get_global: Callable[..., Any] = Private("keras", _STATE, "get_global_attribute").get()
_set_global: Callable[..., Any] = Private("keras", _STATE, "set_global_attribute").get()
# Why private: see `inputs_of`; dead-code elimination of a jaxpr has no public API.
_DCE_JAXPR = Private("jax", "jax._src.interpreters.partial_eval", "dce_jaxpr")


class _TracingStore(_H5IOStore):
    """A read-mode `H5IOStore` whose entries are traced placeholders instead of h5 datasets.

    Why private: `saving_lib._load_state` accepts only Keras's own store classes (it checks with
    `isinstance`), and it is the one place where Keras decides which stored array each variable of
    each layer gets (`load_own_variables`). Subclassing the store lets that exact logic run on
    placeholders; the interface used (`get`, `has_path`, `keys`, `__getitem__`, `__len__`,
    `__contains__`, `__bool__`) is `H5IOStore`'s own.
    """

    def __init__(self, placeholders: dict[str, Any]) -> None:  # no file is opened
        self.mode = "r"
        self._placeholders = placeholders
        self._group = "vars"
        # Each group's entries and every path above an entry, indexed once: Keras asks for a
        # layer's keys and paths once per layer, and a scan per call is quadratic in the layers
        # (docs/benchmarks.md, "Speed report").
        self._keys: dict[str, list[str]] = {}
        self._paths: set[str] = set()
        for name in placeholders:
            group, _, key = name.rpartition("/")
            self._keys.setdefault(group, []).append(key)
            parts = name.split("/")
            self._paths.update("/".join(parts[:i]) for i in range(1, len(parts)))

    def __bool__(self) -> bool:
        return True

    def get(self, path: str) -> _TracingStore:
        self._group = f"{path}/vars" if path else "vars"
        return self

    def has_path(self, path: str) -> bool:
        return path in self._paths

    def keys(self) -> list[str]:
        return list(self._keys.get(self._group, ()))

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        return f"{self._group}/{key}" in self._placeholders

    def __getitem__(self, key: str) -> Any:
        return self._placeholders[f"{self._group}/{key}"]

    def close(self) -> None:
        return None


def tracing_store(placeholders: dict[str, Any]) -> Any:
    return _TracingStore(placeholders)


def cache_walk_skipsets() -> None:
    """Makes Keras's saving walk create no objects while it runs.

    Why private: `saving_lib.get_attr_skipset` builds a reference object (an `Optimizer(1.0)`, a
    `Layer()`) on every call, because it reads its cache under `saving_attr_skiplist_*` but writes
    it under `saving_attr_skipset_*` (Keras 3.15). Inside a `StatelessScope` that construction
    fails (a variable made from a number); filling the key it reads, outside the scope, avoids it.
    """
    for obj_type in (
        "Operation",
        "Layer",
        "Functional",
        "Sequential",
        "Metric",
        "Optimizer",
        "Loss",
    ):
        key = f"saving_attr_skiplist_{obj_type}"
        if _get_global(key, None) is None:
            _set_global(key, _get_attr_skipset(obj_type))


def load_state(
    saveable: Any, store: Any, errors: dict[int, Any], *, skip: Any = None, path: str = ""
) -> None:
    """Keras's own loading walk (`saving_lib._load_state`), collecting each object's failure.

    Why private: it is what `load_weights` runs; no public API walks a model over a store. `skip`
    is treated as already loaded (the optimizer, when a stand-in is walked in its place).
    """
    visited = {id(skip)} if skip is not None else set()
    _load_state(
        saveable,
        store,
        None,
        path,
        visited_saveables=visited,
        failed_saveables=set(),
        error_msgs=errors,
    )


def stateless_updates(scope: keras.StatelessScope) -> dict[int, Any]:
    """The values assigned inside a `StatelessScope`, by `id(variable)`, in assignment order.

    Why private: the scope keeps them in `state_mapping` only; `get_current_value` needs the
    variable, and we want every assignment the walk made.
    """
    return dict(scope.state_mapping)


def is_literal(var: Any) -> bool:
    """Whether a jaxpr operand is a literal (a constant), not a variable."""
    from jax.extend.core import Literal  # public; once reached as `jax._src.core.Literal`

    return isinstance(var, Literal)


def inputs_of(jaxpr: Any, position: int) -> list[int]:
    """The inputs that output `position` of a jaxpr depends on.

    Why private: dead-code elimination of a jaxpr (`partial_eval.dce_jaxpr`) has no public API.
    """
    used = [i == position for i in range(len(jaxpr.outvars))]
    _, used_inputs = _DCE_JAXPR.get()(jaxpr, used)
    return [i for i, flag in enumerate(used_inputs) if flag]


def evaluate_output(closed: Any, position: int, values: list[Any]) -> Any:
    """Output `position` of a closed jaxpr, from the values of the inputs it needs (`inputs_of`).

    Why private: see `inputs_of`; `jax.core.eval_jaxpr` runs the pruned program.
    """
    import jax

    used = [i == position for i in range(len(closed.jaxpr.outvars))]
    pruned, _ = _DCE_JAXPR.get()(closed.jaxpr, used)
    (out,) = jax.core.eval_jaxpr(pruned, closed.consts, *values)
    return out
