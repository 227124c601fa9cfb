"""The buffers a restore reads into: 64-byte aligned (the CPU backend adopts them without a copy),
and from 2 MiB on their own mapping from a huge-page boundary, advised `MADV_HUGEPAGE` (a fault per
2 MiB where the kernel gives huge pages, not one per 4 KiB)."""

from __future__ import annotations

import mmap
import os

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.storage.byte_runs import HUGE_BYTES, aligned_empty

needs_thp = pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
    reason="the kernel has no transparent huge pages",
)


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (smaps: `hg` is
    MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_large_buffers_start_on_a_huge_page_and_are_advised_huge_pages():
    buffer = aligned_empty(4 * HUGE_BYTES + 100)
    assert buffer.ctypes.data % HUGE_BYTES == 0
    assert buffer.nbytes == 4 * HUGE_BYTES + 100
    assert "hg" in _mapping_flags(buffer.ctypes.data)
    buffer[:] = 7  # every byte writable
    assert int(buffer[-1]) == 7


def _mapping_permissions(address: int) -> str | None:
    """The permissions (`/proc/self/maps`, e.g. "rw-p") of the mapping that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, permissions = line.split()[:2]
            start, end = (int(x, 16) for x in bounds.split("-"))
            if start <= address < end:
                return permissions
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc")
@pytest.mark.parametrize("nbytes", [HUGE_BYTES, 3 * HUGE_BYTES + 100, 2 * HUGE_BYTES - 4096])
def test_nothing_past_a_large_buffer_can_be_backed(nbytes):
    """A large buffer's mapping is one huge page longer than the buffer (to start it on a
    boundary); past the buffer's last page it takes no fault. Where memory is backed 2 MiB at a
    time (THP `always`, gVisor), a fault in the buffer's last partial 2 MiB would otherwise back all
    of it, per buffer: a load's peak rose so (docs/benchmarks.md, "The 13-core host again")."""
    buffer = aligned_empty(nbytes)
    buffer[:] = 1
    last_page = (buffer.ctypes.data + nbytes - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    assert _mapping_permissions(last_page) == "rw-p"
    assert _mapping_permissions(last_page + mmap.PAGESIZE) in ("---p", None)


def test_small_buffers_are_64_byte_aligned():
    for nbytes in (1, 1000, (1 << 20) + 3, HUGE_BYTES - 1):
        assert aligned_empty(nbytes).ctypes.data % 64 == 0


@needs_thp
def test_a_restored_shard_is_the_buffer_it_was_read_into(tmp_path, distribution):
    """Each device's shard of a restored array is the huge-page buffer its file was read into,
    adopted by the CPU backend without a copy (a copy would be XLA's own memory, not advised)."""
    mesh = keras.distribution.DeviceMesh((8,), ("model",))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = ("model", None)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))

    def build() -> keras.Model:
        tokens = keras.Input((4,), dtype="int32")
        return keras.Model(tokens, keras.layers.Embedding(8 * 2048, 256, name="embed")(tokens))

    model = build()
    values = np.random.default_rng(0).random((8 * 2048, 256)).astype("float32")  # 2 MiB shards
    model.weights[0].assign(values)
    keras_orbax.save(model, tmp_path, step=1)
    restored = build()
    keras_orbax.restore_sharded(restored, tmp_path)
    array = restored.weights[0].value
    assert isinstance(array, jax.Array) and len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
        pointer = shard.data.unsafe_buffer_pointer()
        assert pointer % HUGE_BYTES == 0, hex(pointer)
        assert "hg" in _mapping_flags(pointer)
    np.testing.assert_array_equal(np.asarray(array), values)
