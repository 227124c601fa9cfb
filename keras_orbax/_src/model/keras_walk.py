"""Each object's own saving and loading methods, run as Keras's saving runs them.

`captured` runs every object's `save_own_variables` and `save_assets` (the walk `save_weights` and
`.keras` saving make) and keeps what is no variable: values such as NumPy arrays, device arrays the
object holds (an attribute of it), and asset files. Variables are saved as sharded arrays; a device
array an object computes as it saves (a LoRA layer's merged kernel, from its variables) is not kept.

`replay` runs every object's `load_own_variables` and `load_assets` on a model whose variables
keras-orbax has just assigned, with a store holding each variable's current value (the very
array, already on its devices: Keras's `assign` keeps it when sharding and dtype match, so nothing
is copied or gathered) and the saved values and files. Whatever Keras's loaders set besides the
variables (a GPTQ layer's `is_gptq_calibrated`, a `Normalization`'s broadcast mean, a lookup
layer's vocabulary) is then set by Keras's own code, as after `load_weights` or `load_model`.

```python
own = captured(model)           # at save time
...                             # restore: arrays read and assigned
replay(model, own)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import keras
import numpy as np

from keras_orbax._src.compat import keras_compat, loading_compat, saving_compat
from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.model import deferred, state_keys
from keras_orbax.errors import CheckpointMismatchError


def captured(model: keras.Model, objects: Sequence[tuple[str, Any]] = ()) -> OwnState:
    """What `model`'s objects store besides their variables: the values their
    `save_own_variables` stores that are host values (NumPy arrays, numbers, strings), and the
    files their `save_assets` writes, by `.weights.h5` group. `objects`: the model's
    `state_keys.saveables`, where the caller has them (`KeyedState.objects`)."""
    values: dict[str, np.ndarray] = {}

    def keep(group: str, key: str, value: Any, obj: Any) -> None:
        if _kept(value, obj):
            values[_entry(group, key)] = np.asarray(value)

    assets: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="keras_orbax_assets_") as folder:
        for group, obj in _stored(model, keep, objects):
            if hasattr(obj, "save_assets"):
                assets |= _saved_assets(obj, group, folder)
    return OwnState(values, assets)


def host_entries(model: keras.Model) -> set[str]:
    """The entries (`<group>/vars/<key>`) where `model`'s objects store values they hold, not
    variables (what `captured` keeps): in a Keras weights file, datasets that no variable takes.
    Changes nothing: `model` may be built under `deferred_init()` and not restored yet."""
    found: set[str] = set()

    def note(group: str, key: str, value: Any, obj: Any) -> None:
        if _kept(value, obj):
            found.add(_entry(group, key))

    # An object's `save_own_variables` may read its variables (keras-hub's DINOv2 embeddings
    # compare two) and assign them: inside `deferred_init()`, a variable with no value yet reads
    # as its initializer makes it, as for shape inference, and no assignment stays. The objects
    # are walked before: Keras's walk makes reference objects (an `Optimizer`) the scope refuses.
    objects = list(state_keys.saveables(model))
    with deferred.deferred_init():
        _stored(model, note, objects)
    return found


def _kept(value: Any, obj: Any) -> bool:
    """Whether a value `obj`'s `save_own_variables` stores is state to keep: no variable, and no
    device array computed as it saves (a LoRA layer's merged kernel): a host value, or a device
    array `obj` holds as an attribute."""
    if isinstance(value, keras.Variable):
        return False
    if not isinstance(value, jax.Array):
        return True
    return any(value is held for held in _attribute_values(obj))


def _attribute_values(obj: Any) -> list[Any]:
    """`obj`'s attributes' values, and the items of those that are lists, tuples or dicts."""
    found = []
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        found.append(value)
        if isinstance(value, list | tuple):
            found.extend(value)
        elif isinstance(value, dict):
            found.extend(value.values())
    return found


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What `replay` did.

    Attributes:
        lacking: Groups whose loader was not run because the saved state lacks a value their
            `save_own_variables` stores (a step saved before keras-orbax kept them), by group:
            the keys lacking.
        not_applied: Groups whose loader was not run because they store a device array they
            compute as they save (`_kept`), by group: the saved values their loader would have
            taken and that they did not get.
    """

    lacking: dict[str, list[str]]
    not_applied: dict[str, list[str]]


def replay(
    model: keras.Model, saved: OwnState | None, aliases: Mapping[str, Sequence[str]] = {}
) -> Replayed:
    """Runs each object's `load_own_variables` (and, where `saved` has assets, `load_assets`)
    over `model`'s current variable values and `saved`'s values and files. `aliases`: other
    groups of an object (`KeyedState.aliases`), where its saved state is looked for too, as
    Keras's loader does.

    An object is left out whose stores include a value neither a variable nor in `saved`: a
    computed device array (a LoRA layer's merged kernel: its variables are restored as saved;
    `Replayed.not_applied`) or a value the saved state lacks (`Replayed.lacking`).

    Raises:
        CheckpointMismatchError: an object's loader failed; the message names each by group.
            Every object's attributes are then as they were before (its variables are the
            caller's to put back).
    """
    entries: dict[str, Any] = {}
    computed: set[str] = set()
    lacking: dict[str, list[str]] = {}
    taken: dict[str, list[str]] = {}
    held = _under_aliases(saved.values if saved is not None else {}, aliases)

    def collect(group: str, key: str, value: Any, obj: Any) -> None:
        entry = _entry(group, key)
        if isinstance(value, keras.Variable):
            if keras_compat.is_allocated(value):
                entries[entry] = keras_compat.current_value(value)
            else:
                computed.add(group)
        elif entry in held:
            entries[entry] = held[entry]
            taken.setdefault(group, []).append(key)
        elif _kept(value, obj):
            lacking.setdefault(group, []).append(key)
        else:
            computed.add(group)

    objects = dict(_stored(model, collect))
    skip = [objects[group] for group in (*computed, *lacking)]
    not_applied = {group: taken[group] for group in computed if group in taken}
    attributes = Attributes(objects.values())
    errors: dict[int, Any] = {}
    files = _under_aliases(saved.assets, aliases) if saved is not None else {}
    # A folder only for asset files: made and removed on every restore, an empty one cost a few
    # ms of a 256 MiB restore (docs/benchmarks.md, "The 256 MiB restore against the floor").
    folder_for_assets = (
        tempfile.TemporaryDirectory(prefix="keras_orbax_assets_")
        if files
        else contextlib.nullcontext("")
    )
    with folder_for_assets as folder:
        assets = _assets_store(folder, files) if files else None
        store = loading_compat.tracing_store(entries)  # indexed once for every object
        for group, obj in objects.items():
            if any(obj is other for other in skip):
                continue
            try:
                if hasattr(obj, "load_own_variables"):
                    _load_own_variables(obj, group, store)
                if assets is not None and hasattr(obj, "load_assets"):
                    obj.load_assets(assets(group))
            except Exception as error:  # named with its group, raised below
                errors[id(obj)] = (group, error)
    if errors:
        attributes.put_back()
        lines = [f"  {group}: {type(e).__name__}: {e}" for group, e in errors.values()]
        raise CheckpointMismatchError(
            f"Keras's own loader failed for {len(errors)} object(s) of model '{model.name}' on "
            "the saved state:\n" + "\n".join(lines[:20])
        )
    return Replayed(lacking, not_applied)


class Attributes:
    """The attributes of some objects as they are now, to be put back: a loader that sets some
    (a table, a device array, a flag) before another fails, or one run over placeholders."""

    def __init__(self, objects: Iterable[Any]) -> None:
        self._before = [(obj, dict(vars(obj))) for obj in objects if hasattr(obj, "__dict__")]

    def put_back(self) -> None:
        """Every attribute set since is as it was, and every one added since is gone."""
        for obj, attributes in self._before:
            for name, value in list(vars(obj).items()):
                if name in attributes and attributes[name] is value:
                    continue
                if name in attributes:
                    object.__setattr__(obj, name, attributes[name])
                else:
                    object.__delattr__(obj, name)


def _under_aliases(
    saved: Mapping[str, Any], aliases: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """`saved`, with what it holds under an object's other group also under its first one
    (`KeyedState.aliases`), where the first holds nothing."""
    found = dict(saved)
    for group, others in aliases.items():
        for other in others:
            for entry, value in saved.items():
                if entry.startswith(f"{other}/"):
                    found.setdefault(group + entry[len(other) :], value)
    return found


def _load_own_variables(obj: Any, group: str, store: Any) -> None:
    """`obj.load_own_variables` over what its `save_own_variables` stored; where Keras's loader
    refuses that, over its variables in the order of its `variable_serialization_spec`, the order
    Keras declares both methods follow. (Keras 3.15's `Dense` and `EinsumDense` store no
    zero point in `gptq` and `awq` mode, which their loaders then expect: Keras cannot load
    such a layer's own `.weights.h5`. docs/coming-from-keras.md has the reproduction.)"""
    try:
        obj.load_own_variables(store.get(group))
    except Exception:
        in_spec_order = _in_spec_order(obj)
        if in_spec_order is None:
            raise
        spec = {_entry(group, str(i)): v for i, v in enumerate(in_spec_order)}
        obj.load_own_variables(loading_compat.tracing_store(spec).get(group))


def _in_spec_order(layer: Any) -> list[Any] | None:
    """The current values of `layer`'s variables named by its `variable_serialization_spec` for
    its quantization mode, in that order (`kernel` is the `_kernel` variable where there is one);
    None where it declares no such spec or a name is not an allocated variable."""
    spec = getattr(layer, "variable_serialization_spec", None)
    mode = getattr(layer, "quantization_mode", None)
    if not isinstance(spec, dict) or mode not in spec:
        return None
    found = []
    for name in spec[mode]:
        variable = getattr(layer, f"_{name}", None)
        if not isinstance(variable, keras.Variable):
            variable = getattr(layer, name, None)
        if variable is None:  # no bias, or a variable this mode's layer lacks
            continue
        if not (isinstance(variable, keras.Variable) and keras_compat.is_allocated(variable)):
            return None
        found.append(keras_compat.current_value(variable))
    return found


def _stored(
    model: keras.Model,
    on_value: Callable[[str, str, Any, Any], None],
    objects: Sequence[tuple[str, Any]] = (),
) -> list[tuple[str, Any]]:
    """`(group, object)` of every object Keras's saving walks (`objects`, if given), in its
    order, each object's `save_own_variables` run and every value it stores handed to
    `on_value(group, key, value, object)` (the last one, for a key stored twice)."""
    found = []
    with saving_compat.optimizers_store_variables(model):
        for group, obj in objects or state_keys.saveables(model):
            if hasattr(obj, "save_own_variables"):
                store = _CapturingStore()
                obj.save_own_variables(store)
                for key, value in store.values.items():
                    on_value(group, key, value, obj)
            found.append((group, obj))
    return found


class _CapturingStore:
    """The write side of Keras's weights store, keeping each value instead of writing it."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[str(key)] = value


def _saved_assets(obj: Any, group: str, folder: str) -> dict[str, bytes]:
    """The files `obj.save_assets` writes, by entry (`<group>/<path>`)."""
    target = os.path.join(folder, group or "_root")
    os.makedirs(target, exist_ok=True)
    obj.save_assets(target)
    files = {}
    for parent, _, names in os.walk(target):
        for name in sorted(names):
            path = os.path.join(parent, name)
            inside = os.path.relpath(path, target).replace(os.sep, "/")
            with open(path, "rb") as file:
                files[posixpath.join(group, inside) if group else inside] = file.read()
    return files


def _assets_store(folder: str, assets: dict[str, bytes]) -> Callable[[str], str | None]:
    """Writes `assets` under `folder`; the returned function gives a group's folder (None where
    the group has no files, as Keras's `DiskIOStore.get`)."""
    root = os.path.realpath(folder)
    for entry, data in assets.items():
        path = os.path.realpath(os.path.join(root, entry))
        if not path.startswith(root + os.sep):
            raise CheckpointMismatchError(
                f"The saved asset '{entry}' names a file outside its layer's assets folder; "
                "it is not restored. No variable was modified."
            )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)

    def group_folder(group: str) -> str | None:
        path = os.path.join(root, group) if group else root
        return path if os.path.isdir(path) else None

    return group_folder


def _entry(group: str, key: str) -> str:
    return f"{group}/vars/{key}" if group else f"vars/{key}"
