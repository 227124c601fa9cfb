"""The versions keras-orbax supports, and the one error for a private symbol that has moved.

Every private Keras, keras-hub, Orbax, JAX and etils symbol keras-orbax uses is declared in
`keras_orbax/_src/compat` as a `Private`; each must resolve in the installed versions, and one
that does not (simulated with a name no version has) must fail with `UnsupportedVersionError`
naming the symbol and the supported versions.
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import jax
import keras
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from keras_orbax._src.compat import (
    hub_compat,
    keras_compat,
    loading_compat,
    orbax_barriers,
    orbax_compat,
    saving_compat,
)
from keras_orbax._src.compat.versions import (
    DECLARED,
    SUPPORTED,
    Private,
    attribute,
    installed_version,
    set_attribute,
)
from keras_orbax.errors import KerasOrbaxError, UnsupportedVersionError
from tests._hub import import_keras_hub

ROOT = Path(__file__).resolve().parent.parent


def test_every_declared_private_symbol_resolves_in_the_installed_versions():
    assert {keras_compat, loading_compat, orbax_compat, orbax_barriers, hub_compat, saving_compat}
    by_distribution: dict[str, list[Private]] = {}
    for symbol in DECLARED:
        by_distribution.setdefault(symbol.distribution, []).append(symbol)
    # Every distribution of the table has symbols declared, and no symbol names another one.
    assert set(by_distribution) == set(SUPPORTED)
    import_keras_hub()
    for symbol in DECLARED:
        assert symbol.get() is not None, symbol


def test_a_moved_attribute_names_the_symbol_and_the_supported_versions():
    symbol = Private("keras", "keras.src.saving.saving_lib", "_no_such_function")
    with pytest.raises(UnsupportedVersionError) as caught:
        symbol.get()
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, KerasOrbaxError)
    message = str(caught.value)
    assert message == (
        f"keras-orbax does not support keras {installed_version('keras')}: it uses "
        "`keras.src.saving.saving_lib._no_such_function`, which that version does not have. "
        'keras-orbax is tested with keras 3.15.1; install it with: pip install "keras==3.15.1"'
    )


def test_a_moved_module_and_a_moved_method_give_the_same_error():
    module = Private("orbax-checkpoint", "orbax.checkpoint._src.no_such_module", "anything")
    with pytest.raises(UnsupportedVersionError, match=r"orbax-checkpoint 0\.12\.8; install") as one:
        module.get()
    assert "`orbax.checkpoint._src.no_such_module.anything`" in str(one.value)
    method = Private("jax", "jax._src.interpreters.pxla", "batched_device_put.no_such_attribute")
    with pytest.raises(UnsupportedVersionError, match=r"jax 0\.10\.2; install") as two:
        method.get()
    assert "`jax._src.interpreters.pxla.batched_device_put.no_such_attribute`" in str(two.value)


def test_keras_hub_error_says_how_to_install_the_tested_version():
    symbol = Private("keras-hub", "keras_hub.src.utils.preset_utils", "_no_such_function")
    import_keras_hub()
    with pytest.raises(UnsupportedVersionError) as caught:
        symbol.get()
    assert str(caught.value).endswith(
        "keras-orbax is tested with keras-hub 0.32.0; "
        "install it with: pip install --no-deps keras-hub==0.32.0"
    )


def test_a_package_that_is_not_installed_is_not_reported_as_moved():
    # Only a module of the package itself going missing is a moved symbol; the package (or a
    # dependency of it) missing keeps Python's own error, which names what to install.
    with pytest.raises(ModuleNotFoundError) as caught:
        Private("keras-hub", "no_such_package_xyz.utils", "f").get()
    assert not isinstance(caught.value, UnsupportedVersionError)


def test_a_moved_instance_attribute_names_the_class():
    variable = keras.Variable(np.zeros((2,), "float32"))
    with pytest.raises(UnsupportedVersionError, match=r"`Variable\._no_such_attribute`"):
        attribute(variable, "_no_such_attribute")
    with pytest.raises(UnsupportedVersionError, match=r"`Variable\._no_such_attribute`"):
        set_attribute(variable, "_no_such_attribute", 1)
    assert not hasattr(variable, "_no_such_attribute")  # nothing was set


def test_keras_instance_accessors_resolve_on_real_objects():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(4)
    dropout = keras.layers.Dropout(0.5, seed=1)
    model = keras.Model(inputs, dropout(dense(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.optimizer.build(model.trainable_variables)
    kernel = dense.kernel

    assert [v.path for v in keras_compat.own_variables(dense)] == [v.path for v in dense.weights]
    assert len(keras_compat.seed_generators(dropout)) == 1
    assert keras_compat.seed_generators(model.optimizer) == []
    built_for = keras_compat.optimizer_variables_built_for(model.optimizer)
    assert [v.path for v in built_for] == [v.path for v in model.trainable_variables]
    assert keras_compat.stored_dtype(kernel) == "float32"
    assert keras_compat.is_allocated(kernel)
    assert np.array_equal(keras_compat.current_value(kernel), kernel.numpy())
    assert keras_compat.layout(kernel) is None  # no distribution set
    keras_compat.initializer(kernel)  # resolves (None or the initializer, once built)
    assert keras_compat.optimizer_steps(model.optimizer) == 0
    keras_compat.set_initial_epoch(model, 3)
    assert model._initial_epoch == 3  # the attribute `fit` reads
    keras_compat.set_initial_epoch(model, None)


def test_monitor_callback_accessors_follow_keras():
    callback = keras_compat.MonitorCallback(monitor="val_loss", mode="auto", min_delta=0.5)
    keras_compat.set_monitor_op(callback)
    assert callback.monitor_op is keras.ops.less  # "loss" is minimized
    assert keras_compat.is_improvement(callback, 1.0, 2.0)  # better by more than min_delta
    assert not keras_compat.is_improvement(callback, 1.8, 2.0)  # better by less
    assert keras_compat.is_improvement(callback, 5.0, None)  # no reference yet


def test_public_fallback_places_the_same_array_as_the_fast_path():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("rows", "cols"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows", None))
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    target = jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)
    indices = sharding.addressable_devices_indices_map(full.shape)
    devices = list(indices)
    values = [np.ascontiguousarray(full[indices[d]]) for d in devices]

    fast = orbax_compat.put_on_devices(target, values, devices)
    public = orbax_compat.put_on_devices_public(target, values, devices)
    for placed in (fast, public):
        assert placed.sharding == sharding
        np.testing.assert_array_equal(np.asarray(placed), full)
        for shard in placed.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_supported_ranges_are_the_ones_pyproject_declares():
    requirements = {
        Requirement(line).name: Requirement(line).specifier
        for line in _pyproject()["project"]["dependencies"]
    }
    for distribution, supported in SUPPORTED.items():
        if distribution in requirements:
            assert requirements[distribution] == SpecifierSet(supported.allowed), distribution
        else:  # keras-hub (installed with --no-deps) and etils (Orbax's) are not requirements
            assert distribution in {"keras-hub", "etils"}
    assert requirements["jaxlib"] == requirements["jax"]


@pytest.mark.skipif(
    os.environ.get("KERAS_ORBAX_LATEST") == "1",
    reason=".ci/latest installs newer versions than the supported ones on purpose",
)
def test_installed_versions_are_supported():
    import_keras_hub()
    for distribution, supported in SUPPORTED.items():
        installed = metadata.version(distribution)
        assert SpecifierSet(supported.allowed).contains(installed), (distribution, installed)
        assert SpecifierSet(supported.allowed).contains(supported.tested), distribution


def test_docs_name_the_tested_keras_hub_version():
    pin = f"keras-hub{SUPPORTED['keras-hub'].allowed}"
    assert pin in (ROOT / "README.md").read_text()
    assert pin in (ROOT / "docs" / "loading.md").read_text()
    hub_comment = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf"pip install --no-deps {re.escape(pin)}", hub_comment)


def test_versions_page_states_the_supported_table():
    page = (ROOT / "docs" / "versions.md").read_text()
    for distribution, supported in SUPPORTED.items():
        assert distribution in page
        assert f" {supported.tested} " in page or f" {supported.tested}," in page, distribution
        if supported.allowed:
            assert f"`{supported.allowed}`" in page, distribution


def test_compat_modules_are_the_only_ones_with_private_imports():
    pattern = re.compile(
        r"from (keras|keras_hub)\.src|import (keras|keras_hub)\.src|jax\._src|"
        r"orbax\.checkpoint\._src|experimental\.v1\._src|etils\.epath\.gpath"
    )
    offenders = []
    for path in sorted((ROOT / "keras_orbax").rglob("*.py")):
        if path.parent.name == "compat":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith(("`", '"', "'")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_license_is_an_spdx_expression_the_build_backend_reads():
    """`license = {text = ...}` made every install print setuptools' deprecation banner; an SPDX
    string (PEP 639) is read from setuptools 77 on, so the build requires that."""
    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    (setuptools,) = [Requirement(r) for r in project["build-system"]["requires"]]
    assert setuptools.name == "setuptools"
    assert not setuptools.specifier.contains("76.1") and setuptools.specifier.contains("77.0")
