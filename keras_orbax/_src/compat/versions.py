"""The versions of Keras, keras-hub, Orbax, JAX and etils that keras-orbax is tested with, and the
one error raised when a private symbol keras-orbax needs is gone from the installed version.

Every private symbol of those packages is reached through `Private.get` or `attribute` in this
subpackage, so that a version that moved one fails with `UnsupportedVersionError` naming the
symbol and the supported versions, not with an `AttributeError` deep inside a restore.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from importlib import metadata
from typing import Any, NamedTuple

from keras_orbax.errors import UnsupportedVersionError


class Supported(NamedTuple):
    allowed: str  # the range pyproject.toml allows ("" where keras-orbax does not bound it)
    tested: str  # the version the test suite ran on
    install: str  # the command that installs a supported version


# Lower bounds only: capping at the next minor release would make pip downgrade the Keras, JAX or
# Orbax a user already has, for symbols that usually do not move. Where one has moved, the first
# use names it and the tested version. tests/test_versions.py checks these ranges against
# pyproject.toml.
SUPPORTED: dict[str, Supported] = {
    "keras": Supported(">=3.15", "3.15.1", 'pip install "keras==3.15.1"'),
    "jax": Supported(">=0.10", "0.10.2", 'pip install "jax[cpu]==0.10.2"'),
    "orbax-checkpoint": Supported(">=0.12.8", "0.12.8", 'pip install "orbax-checkpoint==0.12.8"'),
    # Installed next to the `hub` extra without its own requirements (they pull in TensorFlow).
    "keras-hub": Supported("==0.32.0", "0.32.0", "pip install --no-deps keras-hub==0.32.0"),
    # Orbax's dependency; keras-orbax touches one cache of its path module.
    "etils": Supported("", "1.15.0", 'pip install "etils==1.15.0"'),
}


def distribution_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or of its nightly (`keras-nightly` installs the
    `keras` package under another distribution name); None if neither is installed."""
    for name in (distribution, f"{distribution}-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def installed_version(distribution: str) -> str:
    return distribution_version(distribution) or "(version unknown)"


def unsupported(distribution: str, symbol: str) -> UnsupportedVersionError:
    """The error for `symbol` (a private name of `distribution`) missing in the installed version."""
    supported = SUPPORTED[distribution]
    return UnsupportedVersionError(
        f"keras-orbax does not support {distribution} {installed_version(distribution)}: it uses "
        f"`{symbol}`, which that version does not have. keras-orbax is tested with "
        f"{distribution} {supported.tested}; install it with: {supported.install}"
    )


# Every `Private` made, so that tests/test_versions.py can resolve each in the installed versions.
DECLARED: list[Private] = []


@dataclasses.dataclass(frozen=True)
class Private:
    """A private symbol of `distribution`: the module `module`, or `module.name` (`name` may be
    dotted: `Class.method`). Only modules, classes, functions and objects that live as long as the
    process: `get` resolves each once."""

    distribution: str
    module: str
    name: str = ""

    def __post_init__(self) -> None:
        DECLARED.append(self)

    def __str__(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    def get(self) -> Any:
        """The symbol; `UnsupportedVersionError` if the installed version does not have it."""
        return _resolve(self)


@functools.cache
def _resolve(symbol: Private) -> Any:
    try:
        value = importlib.import_module(symbol.module)
    except ModuleNotFoundError as error:
        top = symbol.module.partition(".")[0]
        missing = error.name or ""
        # The package itself not installed, or a dependency of it missing, is not a moved symbol.
        if missing == top or not f"{symbol.module}.".startswith(f"{missing}."):
            raise
        raise unsupported(symbol.distribution, str(symbol)) from None
    for part in symbol.name.split(".") if symbol.name else ():
        try:
            value = getattr(value, part)
        except AttributeError:
            raise unsupported(symbol.distribution, str(symbol)) from None
    return value


def attribute(obj: Any, name: str, distribution: str = "keras") -> Any:
    """`obj.<name>`, a private attribute each instance holds (no class can be checked beforehand);
    `UnsupportedVersionError` if the installed version's objects do not have it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise unsupported(distribution, f"{type(obj).__qualname__}.{name}") from None


def set_attribute(obj: Any, name: str, value: Any, distribution: str = "keras") -> None:
    """Sets `obj.<name>`, after checking that it exists: setting a renamed attribute would
    silently do nothing."""
    attribute(obj, name, distribution)
    setattr(obj, name, value)
