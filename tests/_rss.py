"""This process's resident memory, from /proc/self/status (Linux), for the memory tests' workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB: "VmRSS" (now), "VmHWM" (the peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_growth(action: Callable[[], Any]) -> int:
    """How many bytes the peak RSS rose above the RSS before `action()`, while it ran."""
    with open("/proc/self/clear_refs", "w") as refs:  # resets the peak (VmHWM) to the current RSS
        refs.write("5")
    before = status_kib("VmRSS")
    action()
    return (status_kib("VmHWM") - before) * 1024
