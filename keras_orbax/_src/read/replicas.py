"""Reading each replicated region from storage once: one process reads it, the others receive it.

When the devices that hold one region of an array (its replicas) belong to several processes, every
process would otherwise read that region from storage. Here exactly one of them does: `share`
assigns each such region to one of the processes that hold it, balancing the bytes each process
reads, from the target shardings alone, so every process computes the same assignment without
talking to the others. The reader puts the region on one of its devices that holds it, every other
device holding it contributes zeros, and a sum over the mesh axes the array is replicated over (a
`psum` in `shard_map`, on the bits, so every value comes back bit for bit) leaves every replica
with the region, as Orbax's `SingleReplicaArrayHandler` does. `Exchange` runs that collective for a
batch of arrays at a time, within the read window, after every process has said its reads went
well (`multihost.agree`), so a failure on one process never leaves the others in a collective.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import mmap
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage.byte_runs import Index

if TYPE_CHECKING:
    from keras_orbax._src.model.matching import ReadRequest
    from keras_orbax._src.read.sharded_read import ReadPlan


@dataclasses.dataclass(frozen=True)
class Sharing:
    """How this process takes part in restoring one array whose replicas span processes.

    The contribution array has a leading axis of `count` replicas, sharded over `axes` (the mesh
    axes the target replicates over), then the target's dimensions, sharded as the target.
    """

    mesh: Mesh
    axes: tuple[str, ...]
    spec: PartitionSpec  # the target's, one entry per dimension
    count: int  # devices that hold each region
    # repr(region) -> the replica whose device contributes the pieces of it read here, and those
    sources: dict[str, tuple[int, list[Index]]]
    received: int  # bytes of the regions this process's devices get from other processes

    @property
    def contribution_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(self.axes, *self.spec))


def enabled(option: bool | None, *, object_storage: bool = False) -> bool:
    """Whether to read each replicated region once: never on one process; else `option`; by
    default (None) in object storage (where each byte fetched costs a request and egress, and
    the store's bandwidth is shared by every process) and on accelerators (whose interconnect
    outruns storage), not from local files on the CPU backend, whose collectives (gloo over TCP)
    measured slower than each process reading its replicas (benchmarks/replica_benchmark.py)."""
    if multihost.process_count() == 1:
        return False
    if option is not None:
        return option
    return object_storage or jax.default_backend() != "cpu"


def share(plan: ReadPlan) -> ReadPlan:
    """`plan` with each region that several processes hold read by one of them only.

    Regions held by one process stay with it. A shared region of some size is split along its
    first dimension into pieces, one per process holding it; each piece goes to the process
    holding it that has the fewest bytes to read so far, largest first, so reads are balanced
    across processes. Arrays whose replicas stay within each process, or whose dtype the sum
    cannot carry bit for bit, are read as before.
    """
    me = jax.process_index()
    load: collections.Counter[int] = collections.Counter()
    layouts: dict[int, _Layout] = {}
    candidates = []  # (-bytes, entry, region, piece, processes holding it)
    for n, (request, _, _) in enumerate(plan.fast):
        layout = _layout(request)
        if layout is None:
            continue
        layouts[n] = layout
        for region, by_process in layout.holders.items():
            if len(by_process) == 1:
                load[next(iter(by_process))] += layout.region_bytes
                continue
            pieces = _pieces(
                layout.regions[region], request.target.shape, len(by_process), layout.itemsize
            )
            for piece, index in enumerate(pieces):
                nbytes = _elements(index, request.target.shape) * layout.itemsize
                candidates.append((-nbytes, n, region, piece, sorted(by_process)))
    readers: dict[tuple[int, str, int], int] = {}
    for negative, n, region, piece, processes in sorted(candidates, key=lambda c: c[:4]):
        readers[n, region, piece] = min(processes, key=lambda p: (load[p], p))
        load[readers[n, region, piece]] -= negative
    fast = list(plan.fast)
    shared = {}
    for n, layout in layouts.items():
        request, array, indices = fast[n]
        sources: dict[str, tuple[int, list[Index]]] = {}
        received = 0
        for index in indices:  # the regions this process's devices hold, in its reading order
            region, holders = repr(index), layout.holders[repr(index)]
            pieces = _pieces(index, request.target.shape, len(holders), layout.itemsize)
            mine = [p for i, p in enumerate(pieces) if readers.get((n, region, i), me) == me]
            if mine:
                sources[region] = (min(holders[me]), mine)
            own = sum(_elements(p, request.target.shape) for p in mine) * layout.itemsize
            received += layout.region_bytes - own
        fast[n] = (request, array, [p for _, pieces in sources.values() for p in pieces])
        shared[request.record.key] = Sharing(
            layout.mesh, layout.axes, layout.spec, layout.count, sources, received
        )
    return dataclasses.replace(plan, fast=fast, shared=shared)


_MIN_PIECE_BYTES = 64 << 10  # a shared region is split among its processes into pieces this big


def _pieces(index: Index, shape: tuple[int, ...], processes: int, itemsize: int) -> list[Index]:
    """The region `index` split along its first dimension into up to `processes` pieces (not
    below `_MIN_PIECE_BYTES`)."""
    if processes == 1 or not shape:
        return [index]
    lo, hi, _ = index[0].indices(shape[0])
    rows, nbytes = hi - lo, _elements(index, shape) * itemsize
    parts = max(1, min(processes, rows, nbytes // _MIN_PIECE_BYTES))
    if parts == 1:
        return [index]
    bounds = [lo + (hi - lo) * i // parts for i in range(parts + 1)]
    return [(slice(a, b), *index[1:]) for a, b in itertools.pairwise(bounds)]


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: Mesh
    axes: tuple[str, ...]
    spec: PartitionSpec
    count: int
    shape: tuple[int, ...]  # of each region
    itemsize: int
    holders: dict[str, dict[int, list[int]]]  # repr(region) -> process -> replica positions
    regions: dict[str, Index]  # repr(region) -> region

    @property
    def region_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _elements(index: Index, shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _layout(request: ReadRequest) -> _Layout | None:
    """Where the replicas of each region are, if some region's replicas span processes."""
    sharding, shape = request.target.sharding, request.target.shape
    if (
        not isinstance(sharding, NamedSharding)
        or sharding.is_fully_addressable
        or request.record.nbytes == 0
        or not _summable(request.target.dtype)
    ):
        return None
    mesh = sharding.mesh
    if not isinstance(mesh, Mesh):  # an abstract mesh: no devices to read onto
        return None
    spec = PartitionSpec(*sharding.spec, *[None] * (len(shape) - len(sharding.spec)))
    used = {a for entry in spec if entry is not None for a in _names(entry)}
    axes = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not axes:
        return None
    count = math.prod(mesh.shape[a] for a in axes)
    contribution = NamedSharding(mesh, PartitionSpec(axes, *spec))
    holders: dict[str, dict[int, list[int]]] = {}
    regions: dict[str, Index] = {}
    indices: Mapping[Any, Any] = contribution.devices_indices_map((count, *shape))
    for device, index in indices.items():
        replica = index[0].start or 0
        regions[repr(index[1:])] = index[1:]
        holders.setdefault(repr(index[1:]), {}).setdefault(device.process_index, []).append(replica)
    if all(len(by_process) == 1 for by_process in holders.values()):
        return None
    itemsize = np.dtype(request.target.dtype).itemsize
    region = sharding.shard_shape(shape)
    return _Layout(mesh, axes, spec, count, region, itemsize, holders, regions)


def _names(entry: Any) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _summable(dtype: Any) -> bool:
    """Whether a sum with zeros gives back every bit: bool, or a dtype of 8 to 64 bits seen as
    unsigned integers (not complex, not sub-byte)."""
    dtype = np.dtype(dtype)
    return dtype == np.bool_ or (
        dtype.kind != "c" and jax.dtypes.itemsize_bits(dtype) in (8, 16, 32, 64)
    )


class Exchange:
    """Restores the shared arrays of a plan a batch at a time, in plan order: each process adds
    the regions it read (`add`), and once a batch holds `window_bytes` of arrays, or the last
    shared array, every process agrees that its reads went well, then runs one collective."""

    def __init__(self, plan: ReadPlan, window_bytes: int) -> None:
        self._shared = plan.shared
        self._window = window_bytes
        order = [request.record.key for request, _, _ in plan.fast]
        self._last = next((k for k in reversed(order) if k in self._shared), None)
        self._batch: list[str] = []
        self._batch_bytes = 0
        self._pending: list[tuple[str, Sharing, jax.Array]] = []
        self._error: BaseException | None = None  # this process's first failure in the batch

    def add(
        self,
        request: ReadRequest,
        regions: Mapping[str, np.ndarray] | None,
        error: BaseException | None = None,
    ) -> dict[str, jax.Array]:
        """Adds one shared array: the regions this process read (None if a read failed, `error`).

        Returns:
            The arrays of the batch this one completes, by key; else nothing.

        Raises:
            The error of any process whose reads failed, on every process (`multihost.agree`).
        """
        key = request.record.key
        sharing = self._shared[key]
        self._error = self._error or error
        if self._error is None and regions is not None:
            try:
                self._pending.append((key, sharing, _contribution(request, sharing, regions)))
            except Exception as caught:  # reported to every process at the batch's agreement
                self._error = caught
        self._batch.append(key)
        self._batch_bytes += request.record.nbytes
        if self._batch_bytes < self._window and key != self._last:
            return {}
        return self._flush()

    def _flush(self) -> dict[str, jax.Array]:
        # The batch's keys name the agreement: processes whose plans differ time out instead of
        # entering different collectives.
        digest = zlib.crc32("\n".join(self._batch).encode())
        pending, self._pending, self._batch, self._batch_bytes = self._pending, [], [], 0
        error, self._error = self._error, None
        try:
            multihost.agree(f"restore_sharded/replicas/{digest:08x}", error)
            summed = _sum_replicas(pending)
        finally:
            for _, _, contribution in pending:
                contribution.delete()
        return summed


def _sum_replicas(pending: Sequence[tuple[str, Sharing, jax.Array]]) -> dict[str, jax.Array]:
    """One collective per mesh: every array summed over the replicas."""
    by_mesh: dict[Mesh, list[tuple[str, Sharing, jax.Array]]] = {}
    for entry in pending:
        by_mesh.setdefault(entry[1].mesh, []).append(entry)
    summed: dict[str, jax.Array] = {}
    for mesh, entries in by_mesh.items():
        program = _program(mesh, tuple((s.axes, s.spec) for _, s, _ in entries))
        outputs = program(*(contribution for _, _, contribution in entries))
        jax.block_until_ready(outputs)
        summed.update(zip((key for key, _, _ in entries), outputs, strict=True))
    return summed


@functools.lru_cache(maxsize=64)
def _program(
    mesh: Mesh, layouts: tuple[tuple[tuple[str, ...], PartitionSpec], ...]
) -> Callable[..., tuple[jax.Array, ...]]:
    """The collective for arrays laid out as `layouts` (replicated axes, target spec): each
    output is the sum of the replicas of its contribution (jit caches it per shapes and dtypes)."""

    def body(*parts: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(
            _sum_bits(part[0], axes) for part, (axes, _) in zip(parts, layouts, strict=True)
        )

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(PartitionSpec(axes, *spec) for axes, spec in layouts),
            out_specs=tuple(spec for _, spec in layouts),
        )
    )


def _sum_bits(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`psum` over `axes` of the bits of `x`: one replica holds the value, the others zeros, so the
    value comes back exactly (-0.0 and NaN payloads too), whatever its dtype."""
    if x.dtype == jnp.bool_:
        return jax.lax.psum(x.astype(jnp.uint8), axes).astype(jnp.bool_)
    bits = jnp.dtype(f"uint{jax.dtypes.itemsize_bits(x.dtype)}")
    summed = jax.lax.psum(jax.lax.bitcast_convert_type(x, bits), axes)
    return jax.lax.bitcast_convert_type(summed, x.dtype)


def _contribution(
    request: ReadRequest, sharing: Sharing, pieces: Mapping[str, np.ndarray]
) -> jax.Array:
    """This process's part of the array to sum: on one of its devices that hold a region, the
    pieces of it read here (zeros around them); zeros on every other device."""
    shape = (sharing.count, *request.target.shape)
    sharding = sharing.contribution_sharding
    dtype = np.dtype(request.target.dtype)
    local = sharding.shard_shape(shape)
    zeros = None
    buffers = []
    indices: Mapping[Any, Any] = sharding.addressable_devices_indices_map(shape)
    for device, index in indices.items():
        region = repr(index[1:])
        replica, read = sharing.sources.get(region, (None, []))
        if replica == (index[0].start or 0):
            buffers.append(jax.device_put(_assemble(index[1:], read, pieces, local, dtype), device))
        elif device.platform != "cpu":
            buffers.append(jnp.zeros(local, dtype, device=device))
        else:
            zeros = _zeros(local, dtype) if zeros is None else zeros
            buffers.append(jax.device_put(zeros, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, buffers)


def _assemble(
    region: Index,
    read: list[Index],
    pieces: Mapping[str, np.ndarray],
    local: tuple[int, ...],
    dtype: np.dtype,
) -> np.ndarray:
    """The region as this process contributes it: the one piece that is all of it, as read; else
    the pieces it read in place, zeros elsewhere."""
    if len(read) == 1 and repr(read[0]) == repr(region):
        return pieces[repr(region)][None]
    out = _zeros(local, dtype)
    start = region[0].start or 0
    for piece in read:
        out[0, piece[0].start - start : piece[0].stop - start] = pieces[repr(piece)]
    return out


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in untouched anonymous pages: they take no memory until written, and are aligned for
    the CPU backend to adopt without a copy."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)
    return mapping[:nbytes].view(dtype).reshape(shape)
