"""Test set-up: 8 virtual CPU devices, the JAX backend, and a distribution fixture.

The environment is set here, before jax or keras is imported by any test module.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import keras
import pytest

N_DEVICES = 8


def pytest_configure(config: pytest.Config) -> None:
    if keras.backend.backend() != "jax":
        raise pytest.UsageError(
            f"keras-orbax tests need KERAS_BACKEND=jax, got {keras.backend.backend()}"
        )
    if jax.device_count() < N_DEVICES:
        raise pytest.UsageError(
            f"keras-orbax tests need {N_DEVICES} devices, got {jax.device_count()}: "
            "XLA_FLAGS was set after jax initialized its backend."
        )


@pytest.fixture
def distribution():
    """Sets a distribution for one test and puts the previous one back.

    Usage: `distribution(dist)` inside the test.
    """
    previous = keras.distribution.distribution()

    def set_distribution(dist):
        keras.distribution.set_distribution(dist)
        return dist

    yield set_distribution
    keras.distribution.set_distribution(previous)
