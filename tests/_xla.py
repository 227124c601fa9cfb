"""The XLA flags of the tests' processes: set by conftest, inherited by the processes tests start.

XLA's backend optimizations are off: the tests' programs are tiny and each is compiled once or
twice, so compiling is most of their cost (a model with one layer of each Keras family builds in
3.2 s instead of 9.7 s, one compile per initializer shape). What the tests compare are values
computed under these same flags, in the test process and the processes it starts. A process that
measures memory runs with XLA's defaults (`as_users_run`), as users do.
"""

from __future__ import annotations

from collections.abc import Mapping

DEVICES = "--xla_force_host_platform_device_count=8"
FAST_COMPILE = "--xla_backend_optimization_level=0"


def for_tests(flags: str) -> str:
    """`flags` with the tests' own added (once: xdist workers inherit the session's)."""
    present = flags.split()
    return " ".join([*present, *(f for f in (DEVICES, FAST_COMPILE) if f not in present)])


def as_users_run(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with XLA's default optimizations back on (the device count kept)."""
    flags = [flag for flag in env.get("XLA_FLAGS", "").split() if flag != FAST_COMPILE]
    return {**env, "XLA_FLAGS": " ".join(flags)}
