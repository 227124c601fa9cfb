"""The regions of each Hugging Face tensor written at its offsets in a safetensors file.

A tensor is a variable rearranged (`hub_tensors.Rearranged`: size-1 axes dropped, transposed),
a variable's bytes otherwise moved (`hub_tensors.Moved`: fetched to one host array, the moves
replayed there, where both fit the window) or computed by keras-hub's operations. A shard in host
memory is written from its own buffer (no copy): an untransposed tensor's shards together, their
runs merged into whole stretches of the file (`file_windows.FileWindows.write_boxes`); a
transposed one band by band, each band of whole rows copied from the shards into one of two
buffers while the other is written. A shard on an accelerator is fetched a window at a time. The
buffers are placed like the file (`file_windows.placed`), so that a band's whole pages go straight
to the disk (O_DIRECT).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from keras_orbax._src.export import (
    box_runs,
    export_checksums,
    file_windows,
    host_moves,
    host_transpose,
    regions,
)
from keras_orbax._src.export.hub_tensors import Computed, HubTensor, Moved, Rearranged
from keras_orbax.errors import SaveFailedError

# A transposed tensor's band: the copy of one overlaps the write of the one before.
_BAND_BYTES = 16 << 20


class TensorWriter:
    """Writes this process's regions of each tensor through `files`: a shard in host memory whole
    from its own buffer (no copy); one on an accelerator window by window. A tensor that is a
    variable's transpose is transposed on the host by the copy threads, a window at a time, into one
    buffer that is reused (its pages are faulted in once)."""

    def __init__(self, files: file_windows.FileWindows, window_bytes: int) -> None:
        self.files, self.window_bytes = files, max(1, window_bytes)
        self._buffers: list[np.ndarray | None] = [None, None]
        # What this process wrote, for process 0 to read back (`export_checksums`): each
        # region's CRC by `<tensor>/<region key>` (under `jax.distributed` only: one process
        # has no other's bytes to check, and a transposed region's CRC costs a copy of it), and
        # where each tensor's regions lie in it.
        self.region_crcs: dict[str, int] = {}
        self._report = jax.process_count() > 1
        self.placements: dict[str, export_checksums.Placement] = {}

    def write(
        self, fd: int, offset: int, tensor: HubTensor, written_from: dict[str, tuple[Any, ...]]
    ) -> list[str]:
        """Writes `tensor`'s regions here; their keys (in the array's coordinates)."""
        source = tensor.source
        on_devices = device_computed(tensor, self.window_bytes)
        if isinstance(source, Moved) and on_devices is None:
            return self._write_moved_on_host(fd, offset, tensor, source, written_from)
        if on_devices is not None:
            array = on_devices.compute()
            _check(tensor, array)
            kept, permutation = list(range(array.ndim)), tuple(range(array.ndim))
        else:
            assert isinstance(source, Rearranged)
            array = source.variable.value
            kept = [axis for axis, n in enumerate(array.shape) if n != 1]
            permutation = source.permutation
        whole = regions.on_host(array)
        moved = permutation != tuple(range(len(permutation)))
        # Fetched windows: a moved block is copied once on the host, half the window each.
        window = self.window_bytes // 2 if moved and not whole else self.window_bytes
        _record(written_from, tensor.name, array, window, whole)
        # the variable's non-1 axes, permuted: the tensor's C order (it may merge some of them)
        view = tuple(tuple(array.shape[axis] for axis in kept)[p] for p in permutation)
        self.placements[tensor.name] = export_checksums.Placement(view, tuple(kept), permutation)
        keys = []
        # Shards in host memory (their own buffers, no copy) are written together: their runs
        # merged into whole stretches of the file, or, transposed, copied band by band into
        # whole rows of the tensor. A fetched window goes before the next is fetched.
        boxes: list[tuple[regions.Index, np.ndarray]] = []
        for region in _own_regions(array, window, whole):
            keys.append(regions.region_key(region.index))
            index = tuple(region.index[axis] for axis in kept)
            block = region.block.reshape([s.stop - s.start for s in index])
            index = tuple(index[p] for p in permutation)
            block = block.transpose(permutation) if moved else block
            if self._report:  # in the tensor's C order: process 0 reads it back so
                crc = export_checksums.region_crc(block)
                self.region_crcs[f"{tensor.name}/{keys[-1]}"] = crc
            if whole:
                boxes.append((index, block))
            elif moved:
                self._write_moved(fd, offset, view, index, block, window)
            else:
                self.files.write_boxes(fd, offset, view, [(index, block)])
            del block
        if boxes and moved and sum(b.size for _, b in boxes) == math.prod(view):
            self._write_bands(fd, offset, view, boxes)
        elif moved:
            for index, block in boxes:
                self._write_moved(fd, offset, view, index, block, window)
        elif boxes:
            self.files.write_boxes(fd, offset, view, boxes)
        return keys

    def _write_moved_on_host(
        self,
        fd: int,
        offset: int,
        tensor: HubTensor,
        source: Moved,
        written_from: dict[str, tuple[Any, ...]],
    ) -> list[str]:
        """The variable fetched to one host array and moved there with NumPy
        (`host_moves.on_host`), the result written whole: from its own buffer where it is
        C-contiguous, else band by band. Process 0 writes it (every process holds the whole
        variable: `device_computed`)."""
        whole = tuple(slice(0, n) for n in tensor.shape)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        written_from[tensor.name] = (tensor.shape, tensor.dtype, sharding, True, 1, True)
        axes = tuple(range(len(tensor.shape)))
        self.placements[tensor.name] = export_checksums.Placement(tensor.shape, axes, axes)
        if jax.process_index() != 0:
            return []
        value = source.variable.value
        result = host_moves.on_host(value, source.moves, self.window_bytes, self.files.copy)
        _check(tensor, result)
        if self._report:
            key = f"{tensor.name}/{regions.region_key(whole)}"
            self.region_crcs[key] = export_checksums.region_crc(result)
        if result.flags.c_contiguous:
            self.files.write_boxes(fd, offset, tensor.shape, [(whole, result)])
        else:
            self._write_bands(fd, offset, tensor.shape, [(whole, result)])
        return [regions.region_key(whole)]

    def _write_bands(
        self,
        fd: int,
        offset: int,
        shape: tuple[int, ...],
        boxes: list[tuple[regions.Index, np.ndarray]],
    ) -> None:
        """A tensor whose boxes (transposed views of shards) tile it, written a band of whole
        rows at a time: every box's part of the band copied into a buffer (the copying threads a
        slab each) while the writing threads write the previous band from the other buffer; each
        band is one stretch of the file. Two buffers of at most half the window each."""
        dtype = boxes[0][1].dtype
        total = math.prod(shape) * dtype.itemsize
        band_bytes = max(1, min(self.window_bytes // 2, _BAND_BYTES))
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        pending: list[Callable[[], int] | None] = [None, None]
        self._keep_at_most(band_bytes + file_windows.ALIGN)
        try:
            for number, band in enumerate(regions.windows(shape, dtype.itemsize, band_bytes)):
                slot = number % 2
                if (written := pending[slot]) is not None:
                    pending[slot] = None
                    written()  # that buffer's band is on its way to the disk: reuse it
                extent = [s.stop - s.start for s in band]
                nbytes = math.prod(extent) * dtype.itemsize
                start = sum(b.start * stride for b, stride in zip(band, strides, strict=True))
                at = offset + start * dtype.itemsize
                buffer = self._take(nbytes, min(band_bytes, total), slot, at)
                buffer = buffer.view(dtype).reshape(extent)
                for index, block in boxes:
                    common = [
                        (max(b.start, i.start), min(b.stop, i.stop))
                        for b, i in zip(band, index, strict=True)
                    ]
                    if any(lo >= hi for lo, hi in common):
                        continue
                    to = buffer[
                        tuple(
                            slice(lo - b.start, hi - b.start)
                            for (lo, hi), b in zip(common, band, strict=True)
                        )
                    ]
                    part = block[
                        tuple(
                            slice(lo - i.start, hi - i.start)
                            for (lo, hi), i in zip(common, index, strict=True)
                        )
                    ]
                    host_transpose.copy(to, part, self.files.copy, self.files.copy_threads)
                pending[slot] = self.files.write_later([(fd, at, buffer)])
                del buffer
        except BaseException:
            for written in pending:  # the buffers stay until no thread writes from them
                if written is not None:
                    with contextlib.suppress(Exception):
                        written()
            raise
        for written in pending:
            if written is not None:
                written()

    def _write_moved(
        self,
        fd: int,
        offset: int,
        shape: tuple[int, ...],
        index: regions.Index,
        moved: np.ndarray,
        window: int,
    ) -> None:
        """`moved` (a transposed view) copied into the buffer a window at a time, each copy
        thread copying a slab of rows, each window then written."""
        itemsize = moved.dtype.itemsize
        self._buffers[1] = None  # one buffer here: with the other, more than the window
        for local in regions.windows(moved.shape, itemsize, window):
            part = moved[local]
            box = tuple(
                slice(i.start + w.start, i.start + w.stop)
                for i, w in zip(index, local, strict=True)
            )
            at = box_runs.stretch_at(offset, shape, box, itemsize)
            buffer = self._take(part.nbytes, min(window, moved.nbytes), 0, at or 0)
            buffer = buffer.view(moved.dtype).reshape(part.shape)
            host_transpose.copy(buffer, part, self.files.copy, self.files.copy_threads)
            if at is not None:  # one stretch of the file: its pages may go straight to the disk
                self.files.write([(fd, at, buffer)])
            else:
                self.files.write_boxes(fd, offset, shape, [(box, buffer)])
            del buffer, part  # the buffer may be replaced by a larger one: never two at a time

    def _keep_at_most(self, nbytes: int) -> None:
        """Drops a buffer larger than `nbytes` (two band buffers stay within the window)."""
        for slot, buffer in enumerate(self._buffers):
            if buffer is not None and buffer.nbytes > nbytes:
                self._buffers[slot] = None

    def _take(self, nbytes: int, wanted: int, slot: int, at: int) -> np.ndarray:
        """`nbytes` of buffer `slot`, placed to be written at file offset `at`
        (`file_windows.placed`); a new buffer of `wanted` (at least `nbytes`) where it is smaller
        (the old one goes first: never two in one slot)."""
        buffer = self._buffers[slot]
        if buffer is None or buffer.nbytes < nbytes + file_windows.ALIGN:
            self._buffers[slot] = None
            size = max(nbytes, wanted, 1) + file_windows.ALIGN
            buffer = self._buffers[slot] = np.empty(size, np.uint8)
        return file_windows.placed(buffer, at, nbytes)


def device_computed(tensor: HubTensor, window_bytes: int) -> Computed | None:
    """The operations `TensorWriter.write` runs on the devices for `tensor`: a computed tensor's;
    a moved one's where its variable spans other processes or the host would hold more than the
    window (the variable, the tensor and two band buffers); None for a rearranged one."""
    source = tensor.source
    if not isinstance(source, Moved):
        return source if isinstance(source, Computed) else None
    value = source.variable.value
    result = math.prod(tensor.shape) * tensor.dtype.itemsize
    bands = 2 * min(window_bytes // 2, _BAND_BYTES, result)
    held = math.prod(value.shape) * np.dtype(value.dtype).itemsize + result + bands
    fits = value.is_fully_addressable and held <= window_bytes
    return None if fits else source.computed


def _record(
    written_from: dict[str, tuple[Any, ...]], name: str, array: jax.Array, window: int, whole: bool
) -> None:
    written_from[name] = (
        tuple(array.shape),
        array.dtype,
        array.sharding,
        bool(array.is_fully_addressable),
        max(1, window),
        whole,
    )


def _own_regions(array: jax.Array, window_bytes: int, whole: bool) -> Any:
    """The regions of `array` this process writes (`regions.own_shards`: each region of the array
    by one process)."""
    return regions.shard_regions(array, regions.own_shards(array), max(1, window_bytes), whole)


def _check(tensor: HubTensor, array: jax.Array | np.ndarray) -> None:
    if tuple(array.shape) != tensor.shape or np.dtype(array.dtype) != tensor.dtype:
        raise SaveFailedError(
            f"{tensor.name}: keras-hub's operations gave {np.dtype(array.dtype).name} "
            f"{list(array.shape)} where the trace gave {tensor.dtype.name} {list(tensor.shape)}."
        )
