"""How a background save keeps the state's shards as they were: views on CPU, copies elsewhere.

A background save must keep the state's shards as they were when `fit` goes on, although the next
train step donates their buffers. On CPU nothing needs copying: a host view of a device buffer
keeps PJRT from donating that buffer (the step writes fresh ones), so the save holds views until it
has written them (`views_pin_buffers`). On an accelerator the shards must cross to the host, a link
far slower than the device's memory: where the device has room for a second copy of the state
beside what training needs, the save copies the shards on the device (which the step does not
donate) and fetches those copies into host buffers in the background, while training goes on;
the writer waits for each shard's fetch (`Shard.filled`). Where it has not, the shards are fetched
while the loop waits. Either way they land in host buffers allocated and touched once, in the
background when training begins: copying into fresh memory costs a page fault per 4 KiB, which is
most of a host copy and varies with the host's load.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("keras_orbax")

_ACTIVE: contextvars.ContextVar[HostStaging | None] = contextvars.ContextVar(
    "keras_orbax_staging", default=None
)
_Kind = tuple[tuple[int, ...], np.dtype]
_PAGE = 4096
# Of a device's memory, what training's peak and a snapshot of the state may take together: the
# rest is left to what the peak so far has not shown (a longer sequence, another program).
_DEVICE_SHARE = 0.95


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
        self._fetches: list[Future] = []  # background fetches into lent buffers
        self._said_no_room = False
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
        self._wait_prepared()
        if self._pinning and all(s.flags.c_contiguous for s in shards):
            # A view of every replica's buffer too: a step donates those it may, and an array
            # donated in part is neither whole nor deleted (using it again crashes).
            # `np.asarray` of a CPU shard is that view, without `device_get`'s cost per array.
            replicas = [np.asarray(s.data) for a in arrays for s in a.addressable_shards]
            with self._lock:
                self._held.extend([*shards, *replicas])
            return list(shards)
        with self._lock:
            buffers = [self._take((tuple(s.shape), np.dtype(s.dtype))) for s in shards]
        pairs = list(zip(buffers, shards, strict=True))
        list(self._copiers.map(_copy_all, _split(pairs, self._workers)))
        return buffers

    def keep_on_device(
        self, arrays: Sequence[jax.Array]
    ) -> tuple[list[np.ndarray], list[Future]] | None:
        """Replica 0 of the shards of `arrays` here, in the order `keep` takes them: copies taken
        now on their devices, fetched in the background into buffers lent until `release`, and
        for each buffer the fetch that fills it; None where views pin the buffers (CPU) or a
        device has no room for the copies beside training's peak, for `keep` to fetch now."""
        self._wait_prepared()
        # Across processes a copy is not this process's alone to take: fetched now there.
        if self._pinning or not all(a.is_fully_addressable for a in arrays):
            return None
        if not self._room_for(arrays):
            return None
        try:
            copies = jax.device_put(list(arrays), may_alias=False)  # dispatched, not waited for
        except jax.errors.JaxRuntimeError as error:  # the device had no room after all
            logger.info("A background save fetches the state while fit waits: %s", error)
            return None
        shards = [s.data for array in copies for s in array.addressable_shards if s.replica_id == 0]
        for shard in shards:
            shard.copy_to_host_async()
        with self._lock:
            buffers = [self._take((tuple(s.shape), np.dtype(s.dtype))) for s in shards]
        filled: list[Future] = []
        for run in _split(list(zip(buffers, shards, strict=True)), self._workers):
            count = len(run)  # before the fetch empties it
            filled += [self._copiers.submit(_fetch_all, run)] * count
        with self._lock:
            self._fetches += dict.fromkeys(filled)
        return buffers, filled

    def _room_for(self, arrays: Sequence[jax.Array]) -> bool:
        need: dict[Any, int] = defaultdict(int)
        for array in arrays:
            for shard in array.addressable_shards:
                need[shard.device] += shard.data.nbytes
        for device, nbytes in need.items():
            stats = device.memory_stats() or {}
            if "bytes_limit" not in stats:  # CPU: the copy is in host memory
                continue
            peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
            if peak + nbytes > stats["bytes_limit"] * _DEVICE_SHARE:
                if not self._said_no_room:
                    self._said_no_room = True
                    logger.info(
                        "A background save fetches the state to the host while fit waits: %s "
                        "has no room for a copy of its %.2f GiB beside training's peak of %.2f "
                        "GiB (of %.2f GiB).",
                        device,
                        nbytes / 2**30,
                        peak / 2**30,
                        stats["bytes_limit"] / 2**30,
                    )
                return False
        return True

    def release(self) -> None:
        """Takes back every buffer lent: the save that used them has finished (its fetches
        too, which a failed save may not have waited for)."""
        with self._lock:
            fetches, self._fetches = self._fetches, []
        for fetch in fetches:
            fetch.exception()  # waited for; what it raised failed its save already
        with self._lock:
            for kind, buffer in self._lent:
                self._free[kind].append(buffer)
            self._lent.clear()
            self._held.clear()

    def _wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def close(self) -> None:
        """Frees the buffers."""
        self._wait_prepared()
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


def _fetch_all(pairs: list[tuple[np.ndarray, jax.Array]]) -> None:
    """Each device copy into its buffer, in order, and let go of at once (its device memory and
    the host array `np.asarray` keeps)."""
    pairs.reverse()
    while pairs:
        buffer, shard = pairs.pop()
        np.copyto(buffer, np.asarray(shard))
        del shard


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for buffer, shard in pairs:
        np.copyto(buffer, shard)


def _split(pairs: list[tuple[np.ndarray, Any]], parts: int) -> list[list[tuple[np.ndarray, Any]]]:
    """`pairs` in at most `parts` consecutive runs of about equal bytes (one task per copying
    thread, not one per shard: thousands of small shards would queue as many futures)."""
    total = sum(buffer.nbytes for buffer, _ in pairs)
    runs: list[list[tuple[np.ndarray, Any]]] = [[]]
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
