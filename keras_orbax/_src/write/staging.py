"""How a background save keeps the state's shards as they were: views on CPU, warm copies elsewhere.

A background save must keep the state's shards as they were when `fit` goes on, although the next
train step donates their buffers. On CPU nothing needs copying: a host view of a device buffer
keeps PJRT from donating that buffer (the step writes fresh ones), so the save holds views until it
has written them (`views_pin_buffers`). Elsewhere the shards are copied to the host. Copying into
freshly allocated memory costs a page fault per 4 KiB, which is most of that copy and varies with
the host's load (0.12 s median, 1.4 s at worst, for 768 MiB on 2 cores). `HostStaging` allocates
and touches its buffers once, in the background when training begins, and copies into them with
several threads, so each save pays for a warm `memcpy` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

_ACTIVE: contextvars.ContextVar[HostStaging | None] = contextvars.ContextVar(
    "keras_orbax_staging", default=None
)
_Kind = tuple[tuple[int, ...], np.dtype]
_PAGE = 4096


class HostStaging:
    """What keeps the shards of one state unchanged for a save: views of them on CPU, reusable host
    buffers elsewhere; one save at a time.

    Example (what `ModelCheckpoint` does):

        staging = HostStaging()
        staging.prepare(v.value for v in model.variables)   # returns at once
        with staging.active():
            write_step(..., blocking=False)                  # keeps the shards (`keep`)
        staging.release()                                    # after that save has committed
    """

    def __init__(self) -> None:
        self._free: dict[_Kind, list[np.ndarray]] = defaultdict(list)
        self._lent: list[tuple[_Kind, np.ndarray]] = []
        self._held: list[np.ndarray] = []  # views of device buffers, where they pin them
        self._pinning = False
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None
        self._workers = min(8, os.cpu_count() or 1)
        self._copiers = ThreadPoolExecutor(self._workers, "keras_orbax_staging")

    def prepare(self, arrays: Iterable[jax.Array]) -> None:
        """Starts allocating and touching a buffer for each shard of `arrays` that a save copies
        (replica 0 of each shard this process holds), unless views of them pin their buffers;
        returns at once."""
        shards = [
            shard
            for array in arrays
            for shard in array.addressable_shards
            if shard.replica_id == 0 and shard.data.size > 0
        ]
        kinds = [(tuple(s.data.shape), np.dtype(s.data.dtype)) for s in shards]
        platforms = {s.device.platform for s in shards}
        self._preparing = threading.Thread(
            target=self._allocate, args=(kinds, platforms), name="keras_orbax_staging", daemon=True
        )
        self._preparing.start()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within it, saves keep the shards they write here (`keep`)."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def keep(self, shards: Sequence[np.ndarray], arrays: Sequence[jax.Array]) -> list[np.ndarray]:
        """`shards` (replica 0 of the shards of `arrays` here, on the host) as C-contiguous host
        arrays that stay unchanged until `release`: the shards themselves where views pin their
        device buffers, else copies in buffers lent until then."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._pinning and all(s.flags.c_contiguous for s in shards):
            # A view of every replica's buffer too: a step donates those it may, and an array
            # donated in part is neither whole nor deleted (using it again crashes).
            replicas = jax.device_get([s.data for a in arrays for s in a.addressable_shards])
            with self._lock:
                self._held.extend([*shards, *replicas])
            return list(shards)
        with self._lock:
            buffers = [self._take((tuple(s.shape), np.dtype(s.dtype))) for s in shards]
        pairs = list(zip(buffers, shards, strict=True))
        list(self._copiers.map(_copy_all, _split(pairs, self._workers)))
        return buffers

    def release(self) -> None:
        """Takes back every buffer lent: the save that used them has finished."""
        with self._lock:
            for kind, buffer in self._lent:
                self._free[kind].append(buffer)
            self._lent.clear()
            self._held.clear()

    def close(self) -> None:
        """Frees the buffers."""
        if self._preparing is not None:
            self._preparing.join()
        self._copiers.shutdown()
        with self._lock:
            self._free.clear()
            self._lent.clear()
            self._held.clear()

    def _take(self, kind: _Kind) -> np.ndarray:
        free = self._free[kind]
        buffer = free.pop() if free else np.empty(kind[0], kind[1])
        self._lent.append((kind, buffer))
        return buffer

    def _allocate(self, kinds: list[_Kind], platforms: set[str]) -> None:
        self._pinning = bool(platforms) and all(map(views_pin_buffers, platforms))
        if self._pinning:
            return
        list(self._copiers.map(time.sleep, [0.001] * self._workers))  # its threads started now
        for shape, dtype in kinds:
            buffer = np.empty(shape, dtype)
            buffer.reshape(-1).view(np.uint8)[::_PAGE] = 0  # every page faulted in now
            with self._lock:
                self._free[(shape, dtype)].append(buffer)


@functools.cache
def views_pin_buffers(platform: str) -> bool:
    """Whether a host view of an array on `platform` keeps a train step that donates the array
    from reusing its buffer. PJRT's CPU client does not donate a buffer that has an external
    reference (a view from `np.asarray`): the step writes a fresh one. JAX does not document this,
    so it is probed once here rather than assumed; an accelerator's `np.asarray` is a copy (False).
    """
    source = jax.device_put(np.zeros(_PAGE, np.uint8), jax.local_devices(backend=platform)[0])
    view = np.asarray(source)
    if view.ctypes.data != source.unsafe_buffer_pointer():
        return False
    jax.jit(lambda a: a + 1, donate_argnums=0)(source).block_until_ready()
    return not source.is_deleted() and not view.any()


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for buffer, shard in pairs:
        np.copyto(buffer, shard)


def _split(
    pairs: list[tuple[np.ndarray, np.ndarray]], parts: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """`pairs` in at most `parts` consecutive runs of about equal bytes (one task per copying
    thread, not one per shard: thousands of small shards would queue as many futures)."""
    total = sum(buffer.nbytes for buffer, _ in pairs)
    runs: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    done = 0
    for pair in pairs:
        if runs[-1] and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(pair)
        done += pair[0].nbytes
    return runs


def active() -> HostStaging | None:
    """The staging of the save being started, if its caller set one (`HostStaging.active`)."""
    return _ACTIVE.get()
