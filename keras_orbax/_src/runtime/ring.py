"""Bytes passed around the ring of processes, process `i` to process `i + by` (mod n), over JAX's
own collectives: a `ppermute` in `shard_map` over a mesh of the processes' devices (gloo over TCP
on CPU, the interconnect on accelerators), so nothing goes through a shared filesystem. Each of a
process's devices carries a share of each chunk at once (lanes), over its own link.

A collective: every process calls `shift` at the same point with its payload (empty if it has
nothing to send). Each payload's length goes over the coordination service (`multihost.gather`), its
bytes over the ring, sent from where they lie: it carries its own checksums, which whoever reads it
checks (a local tier's part: `format.process_parts.unpack`), off the train loop.

```python
from_previous = ring.shift(my_bytes, by=1, name="...")  # process i gets process i-1's bytes
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keras_orbax._src.runtime import multihost

# Payloads are padded to a multiple of this: a payload of about the same size each time (a
# process's part of a step) reuses one compiled program.
_GRAIN = 1 << 16
# Sent in chunks of at most this: the exchange holds one chunk at a time on one device per
# process, beside the training state.
_CHUNK_BYTES = 64 << 20
AXIS = "process"
LANE = "lane"


def shift(payload: Any, *, by: int, name: str) -> memoryview:
    """Sends `payload` (any bytes-like object) to process `(me + by) % n` and returns what process
    `(me - by) % n` sent (a view of the buffer it arrived in).

    Raises:
        ProcessSyncError: a process did not reach the exchange (`multihost.gather`).
    """
    n, me = multihost.process_count(), multihost.process_index()
    body = np.frombuffer(payload, np.uint8)  # a view: sent from where it lies
    sizes = multihost.gather(f"{name}/sizes", body.size)  # each length, and what all pad to
    total = max(sizes)
    mesh = _mesh(n)
    lanes = mesh.shape[LANE]
    unit = _GRAIN * lanes  # a chunk is a whole number of grains per lane
    width = max(1, min(_CHUNK_BYTES // unit, -(-total // unit))) * unit
    sharding = NamedSharding(mesh, PartitionSpec(AXIS, LANE))
    program = _program(mesh, by % n)
    received = np.empty(-(-total // width) * width, np.uint8)
    for start in range(0, total, width):  # the devices hold one chunk at a time
        chunk = body[start : start + width]
        if chunk.size < width:  # the last: padded (the others are views of the payload)
            chunk = np.concatenate([chunk, np.zeros(width - chunk.size, np.uint8)])
        mine = [
            jax.device_put(lane[None], device)
            for lane, device in zip(np.split(chunk, lanes), mesh.devices[me], strict=True)
        ]
        ring = jax.make_array_from_single_device_arrays((n, width), sharding, mine)
        out = program(ring)
        for shard in out.addressable_shards:  # each lane's piece, where it lies in the chunk
            lane = shard.index[1].start or 0
            received[start + lane : start + lane + width // lanes] = np.asarray(shard.data)[0]
        del mine, ring, out
    return received.data[: sizes[(me - by) % n]]


def _mesh(n: int) -> Mesh:
    """A mesh of `n` rows, one per process, of as many of each process's devices as every
    process has (lanes: each carries its share of a chunk, at once)."""
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(device.process_index, []).append(device)
    lanes = min(len(by_process[p]) for p in range(n))
    return Mesh(np.array([by_process[p][:lanes] for p in range(n)]), (AXIS, LANE))


@functools.lru_cache(maxsize=8)
def _program(mesh: Mesh, by: int) -> Callable[[jax.Array], jax.Array]:
    n = mesh.shape[AXIS]
    perm = [(i, (i + by) % n) for i in range(n)]
    return jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, AXIS, perm),
            mesh=mesh,
            in_specs=PartitionSpec(AXIS, LANE),
            out_specs=PartitionSpec(AXIS, LANE),
        )
    )
