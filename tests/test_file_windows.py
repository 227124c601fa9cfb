"""`file_windows`: regions written whole at known offsets, each file by one thread at a time, and
the exports that write through it (`.weights.h5` datasets allocated up front and written by offset
after h5py has closed the file; safetensors).

The oracles: NumPy's own C-order bytes of the whole array at the offset, h5py's reader, Keras's
`load_weights`, and the previous export's bytes after a real write failure (the kernel's EFBIG).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import resource
import signal
import threading
from pathlib import Path

import h5py
import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.export import box_runs, file_windows, host_transpose
from keras_orbax.errors import SaveFailedError
from tests import _hf_export, _models
from tests._direct_io import cached_pages, filesystem_type, refuses_o_direct

OFFSET = 4096 + 24  # not aligned to anything: the pieces' offsets are the file's, not the block's


def _write_boxes(path: Path, shape: tuple[int, ...], dtype: str, boxes: list[tuple[slice, ...]]):
    """`boxes` of a random array of `shape` written at OFFSET of a file of the right size;
    returns the array."""
    rng = np.random.default_rng(3)
    array = rng.standard_normal(shape).astype(dtype)
    with open(path, "wb") as f:
        f.truncate(OFFSET + array.nbytes + 100)
    with file_windows.FileWindows() as files:
        fd = files.open(path)
        for box in boxes:
            files.write_boxes(fd, OFFSET, shape, [(box, np.ascontiguousarray(array[box]))])
        files.sync()
    return array


def _stored(path: Path, array: np.ndarray) -> np.ndarray:
    data = path.read_bytes()
    assert data[:OFFSET] == bytes(OFFSET)
    assert data[OFFSET + array.nbytes :] == bytes(100)
    return np.frombuffer(data[OFFSET : OFFSET + array.nbytes], array.dtype).reshape(array.shape)


@pytest.mark.parametrize(
    "shape, boxes",
    [
        # column blocks: one short run per row, more runs than threads
        ((96, 40), [(slice(0, 96), slice(c, c + 10)) for c in range(0, 40, 10)]),
        # row blocks: one run each, fewer than the threads
        ((96, 40), [(slice(r, r + 32), slice(0, 40)) for r in range(0, 96, 32)]),
        # a box of a 3-d array cut on the middle axis, and one on all three
        (
            (6, 10, 12),
            [
                (slice(0, 6), slice(0, 5), slice(0, 12)),
                (slice(0, 3), slice(5, 10), slice(0, 12)),
                (slice(3, 6), slice(5, 10), slice(0, 7)),
                (slice(3, 6), slice(5, 10), slice(7, 12)),
            ],
        ),
        # one contiguous run of 20 MiB
        ((5 << 10, 1 << 10), [(slice(0, 5 << 10), slice(0, 1 << 10))]),
    ],
)
def test_every_box_lands_at_its_offset(tmp_path, shape, boxes):
    path = tmp_path / "f.bin"
    array = _write_boxes(path, shape, "float32", boxes)
    np.testing.assert_array_equal(_stored(path, array), array)


def _write_together(path: Path, shape: tuple[int, ...], boxes: list[tuple[slice, ...]]):
    """`boxes` of a random array written by one `write_boxes`; returns the array."""
    array = np.random.default_rng(5).standard_normal(shape).astype("float32")
    with open(path, "wb") as f:
        f.truncate(OFFSET + array.nbytes + 100)
    with file_windows.FileWindows() as files:
        fd = files.open(path)
        blocks = [(box, np.ascontiguousarray(array[box])) for box in boxes]
        assert files.write_boxes(fd, OFFSET, shape, blocks) == sum(b.nbytes for _, b in blocks)
        files.sync()
    return array


@pytest.mark.parametrize(
    "shape, boxes",
    [
        # column blocks: short runs that together cover whole rows, more than IOV_MAX of them
        ((3000, 40), [(slice(0, 3000), slice(c, c + 10)) for c in range(0, 40, 10)]),
        # a tiling of a 3-d array, boxes of unequal shapes
        (
            (6, 10, 12),
            [
                (slice(0, 6), slice(0, 5), slice(0, 12)),
                (slice(0, 3), slice(5, 10), slice(0, 12)),
                (slice(3, 6), slice(5, 10), slice(0, 7)),
                (slice(3, 6), slice(5, 10), slice(7, 12)),
            ],
        ),
        # long runs (12 MiB rows) and one short one
        ((3, 3 << 20), [(slice(0, 2), slice(0, 3 << 20)), (slice(2, 3), slice(0, 3 << 20))]),
    ],
)
@pytest.mark.parametrize("max_runs", [None, 7])
def test_boxes_written_together_land_at_their_offsets(
    tmp_path, monkeypatch, shape, boxes, max_runs
):
    """With `max_runs`, more runs than `write_boxes` holds at a time: written a band of rows at a
    time (boxes cut at the bands' rows, rows of unequal boxes included)."""
    if max_runs is not None:
        monkeypatch.setattr(file_windows, "_MAX_RUNS", max_runs)
    path = tmp_path / "f.bin"
    array = _write_together(path, shape, boxes)
    np.testing.assert_array_equal(_stored(path, array), array)


def test_without_the_c_librarys_pwritev_each_run_is_written_by_pwrite(tmp_path, monkeypatch):
    """Where the C library has no `pwritev` (not found through ctypes), column boxes still land at
    their offsets, a `pwrite` per run."""
    monkeypatch.setattr(box_runs, "_pwritev", None)
    path = tmp_path / "f.bin"
    array = _write_together(path, (50, 40), [(slice(0, 50), slice(c, c + 8)) for c in (0, 8, 16)])
    stored = _stored(path, array)
    np.testing.assert_array_equal(stored[:, :24], array[:, :24])
    assert not stored[:, 24:].any()  # the box not given is left as it was


def test_boxes_written_together_leave_the_gaps_between_them_untouched(tmp_path):
    """Boxes that do not tile the array (another process writes the rest): no byte outside them
    is written, though their runs are merged into `pwritev`s."""
    shape = (64, 40)
    boxes = [(slice(0, 64), slice(0, 10)), (slice(0, 64), slice(20, 30))]
    path = tmp_path / "f.bin"
    array = _write_together(path, shape, boxes)
    expected = np.zeros_like(array)
    for box in boxes:
        expected[box] = array[box]
    np.testing.assert_array_equal(_stored(path, array), expected)


def test_a_short_pwritev_is_resumed_where_it_stopped(tmp_path, monkeypatch):
    """The kernel may write part of a `pwritev` (a signal, a file size limit): the rest, from the
    middle of a piece, is written by the next call."""
    real = box_runs._pwritev
    calls = []

    def at_most_1000_bytes(fd, address, count, offset):  # a real write, cut short as the kernel may
        calls.append(count)
        iovecs = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(address))
        kept = iovecs.reshape(count, 2).copy()
        kept[:, 1] = np.diff(np.minimum(np.cumsum(kept[:, 1]), 1000), prepend=0)
        kept = kept[kept[:, 1] > 0]
        return real(fd, kept.ctypes.data, len(kept), offset)

    monkeypatch.setattr(box_runs, "_pwritev", at_most_1000_bytes)
    path = tmp_path / "f.bin"
    shape = (50, 40)
    array = _write_together(path, shape, [(slice(0, 50), slice(c, c + 8)) for c in range(0, 40, 8)])
    np.testing.assert_array_equal(_stored(path, array), array)
    assert len(calls) >= array.nbytes // 1000


def test_column_split_shards_are_written_in_few_system_calls(tmp_path, distribution, monkeypatch):
    """An export of an array split across its columns writes whole stretches of rows: far fewer
    write calls than the shards have runs (one `pwrite` per run before), and Keras reads it back."""
    calls = []
    monkeypatch.setattr(file_windows.os, "pwrite", _counted(file_windows.os.pwrite, calls))
    monkeypatch.setattr(box_runs, "_pwritev", _counted(box_runs._pwritev, calls))
    distribution(_models.model_parallel((2, 4)))

    def wide() -> keras.Model:
        inputs = keras.Input((2048,))
        return keras.Model(inputs, keras.layers.Dense(512, name="wide")(inputs))

    model = wide()
    _models.fill_arange(model)
    kernel = model.get_layer("wide").kernel
    columns = {s.index[1].start for s in kernel.value.addressable_shards}
    assert len(columns) == 4
    path = keras_orbax.save_weights(model, tmp_path / "m.weights.h5", window_bytes=1 << 30)
    runs = 2048 * len(columns)
    assert len(calls) < runs // 10, len(calls)
    twin = wide()
    twin.load_weights(path)
    for a, b in zip(twin.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)


def _counted(real, calls: list[int]):
    def counted(*args):  # the real call, counted
        calls.append(1)
        return real(*args)

    return counted


def test_each_file_is_written_by_one_thread_at_a_time(tmp_path, monkeypatch):
    """A local filesystem serializes writes to one file: a window's pieces of each of two files
    are written by one thread at a time, in file order (8 threads shared each file before), and
    every byte lands where it belongs."""
    real_pwrite, real_pwritev = file_windows.os.pwrite, box_runs._pwritev
    lock = threading.Lock()
    busy: dict[int, int] = {}
    most: dict[int, int] = {}
    order: dict[int, list[int]] = {}

    def watched(real):
        def write(fd, *args):  # the real write, its overlap with others on `fd` counted
            with lock:
                busy[fd] = busy.get(fd, 0) + 1
                most[fd] = max(most.get(fd, 0), busy[fd])
                order.setdefault(fd, []).append(args[-1])  # the offset
            try:
                threading.Event().wait(0.002)  # long enough for other threads to overlap it
                return real(fd, *args)
            finally:
                with lock:
                    busy[fd] -= 1

        return write

    monkeypatch.setattr(file_windows.os, "pwrite", watched(real_pwrite))
    monkeypatch.setattr(box_runs, "_pwritev", watched(real_pwritev))
    size = (8 << 20) + 5
    data = np.random.default_rng(0).integers(0, 255, 2 * size, dtype=np.uint8)
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for path in paths:
        path.write_bytes(bytes(size))
    with file_windows.FileWindows() as files:
        fds = [files.open(path) for path in paths]
        half = size // 2
        pieces = [
            (fd, at, data[i * size + at : i * size + end])
            for i, fd in enumerate(fds)
            for at, end in ((half, size), (0, half))
        ]
        assert files.write(pieces) == 2 * size
        # windows in flight together (a band written while the next is filled): still one
        pending = [files.write_later(pieces[i : i + 1]) for i in range(len(pieces))]
        assert sum(wait() for wait in pending) == 2 * size
        files.sync()
    assert most == {fd: 1 for fd in fds}
    for fd in fds:
        assert order[fd][:2] == sorted(order[fd][:2]) and len(order[fd]) == 4  # in file order
    for i, path in enumerate(paths):
        assert path.read_bytes() == data[i * size : (i + 1) * size].tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_h5_datasets_are_written_by_offset_and_read_back_exactly(
    tmp_path, distribution, dtype
):
    """Each dataset is allocated when created and its bytes lie at its offset in the file as
    NumPy's C order; h5py and Keras's `load_weights` read back exactly the model's values."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp(dtype=dtype)
    _models.fill_arange(model)
    path = keras_orbax.save_weights(model, tmp_path / "m.weights.h5")
    raw = path.read_bytes()
    values = {v.path: np.asarray(v.value) for v in model.weights}
    with h5py.File(path, "r") as h5:
        datasets = []
        h5.visititems(lambda n, o: datasets.append(o) if isinstance(o, h5py.Dataset) else None)
        assert len(datasets) == len(values)
        for dataset in datasets:
            plist = dataset.id.get_create_plist()
            assert plist.get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY, dataset.name
            assert plist.get_fill_time() == h5py.h5d.FILL_TIME_NEVER, dataset.name
            offset = dataset.id.get_offset()
            stored = raw[offset : offset + dataset.id.get_storage_size()]
            want = np.asarray(dataset[()]).astype(dataset.dtype)
            assert stored == want.tobytes(), dataset.name
    twin = _models.mlp(dtype=dtype)
    twin.load_weights(path)
    for variable in twin.weights:
        got = np.asarray(variable.value)
        assert got.dtype == values[variable.path].dtype
        np.testing.assert_array_equal(got, values[variable.path], err_msg=variable.path)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_write_failing_part_way_leaves_the_previous_export(tmp_path, distribution):
    """The kernel refuses the weights file past 12 KiB (RLIMIT_FSIZE: EFBIG) part-way through
    the threads' writes of a window: the export fails, nothing it staged is left, and the
    previous export is the same, byte for byte."""
    distribution(_hf_export.model_parallel("llama3"))
    backbone = _hf_export.backbone_class("llama3")(**_hf_export.config("llama3"))
    _hf_export.fill(backbone)
    directory = tmp_path / "hf"
    keras_orbax.export_to_transformers(backbone, directory, window_bytes=4096)
    before = _digests(directory)
    assert (directory / "model.safetensors").stat().st_size > 20 << 10
    _hf_export.fill(backbone, seed=1)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 10, old[1]))
    try:
        with pytest.raises(SaveFailedError, match="File too large"):
            keras_orbax.export_to_transformers(backbone, directory, window_bytes=4096)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert _digests(directory) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    "shape, permutation",
    [
        ((512, 1024), (1, 0)),
        ((256, 8, 64), (1, 2, 0)),
        ((8, 64, 512), (2, 0, 1)),
        ((5, 3), (1, 0)),
        # the source's contiguous axis not a multiple of the elements moved together (16 bytes)
        ((515, 1030), (1, 0)),
        ((7, 300, 97), (2, 1, 0)),
    ],
)
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float32", "float64", "complex128"])
def test_a_transposed_view_is_copied_exactly_by_the_threads(shape, permutation, dtype):
    """Tiles and slabs cover the buffer once: every byte equals NumPy's transpose's (odd sizes
    leave partial tiles at every edge; random bytes: NaN payloads included)."""
    dtype = np.dtype(jax.numpy.dtype(dtype))
    count = int(np.prod(shape)) * dtype.itemsize
    raw = np.random.default_rng(1).integers(0, 256, count, dtype=np.uint8)
    source = raw.view(dtype).reshape(shape)
    for view in (source.transpose(permutation)[:, 1:], source[..., ::2].transpose(permutation)):
        to = np.zeros(view.shape, view.dtype)
        with file_windows.FileWindows() as files:
            host_transpose.copy(to, view, files.map, files.copy_threads)
        assert to.tobytes() == np.ascontiguousarray(view).tobytes()


def test_stretches_are_back_to_back_runs_within_the_limit(monkeypatch):
    """Each `pwritev` takes back-to-back runs only, at most `_IOV_MAX` of them; together they
    take every run once, in order."""
    monkeypatch.setattr(box_runs, "_IOV_MAX", 5)
    length = np.array([10] * 12 + [60, 60, 60] + [7, 7], np.int64)
    at = np.concatenate([[0], np.cumsum(length)[:-1]])
    at[15:] += 1000  # a gap before the last two runs
    stretches = box_runs._stretches(at, length)
    assert [r for a, b in stretches for r in range(a, b)] == list(range(len(at)))
    for a, b in stretches:
        assert all(at[i + 1] == at[i] + length[i] for i in range(a, b - 1))
    # 5 runs at most; the gap before run 15 starts a new one
    assert stretches == [(0, 5), (5, 10), (10, 15), (15, 17)]


@pytest.mark.parametrize("order", ["one window", "each alone, last first"])
def test_placed_pieces_go_straight_to_the_disk_their_edge_pages_through_the_cache(tmp_path, order):
    """Buffers placed like the file (`placed`) are written with O_DIRECT: every whole page of a
    piece of at least `DIRECT_MIN` bytes goes straight to the disk (none of them is left in the
    page cache), the partial pages it shares with its neighbours go through the cache, a shorter
    piece all of it; every byte lands where it belongs."""
    if reason := refuses_o_direct(tmp_path):
        pytest.skip(reason)
    align, prefix = file_windows.ALIGN, 1000
    sizes = [(3 << 20) + 123, 5 << 20, (2 << 20) + 7, 1 << 19]  # the last under DIRECT_MIN
    data = np.random.default_rng(5).integers(0, 255, sum(sizes), dtype=np.uint8)
    path = tmp_path / "file.bin"
    path.write_bytes(b"h" * prefix)
    pieces, direct_pages, at = [], np.zeros(-(-(prefix + data.size) // align), bool), prefix
    keep = []
    for size in sizes:
        held = np.empty(size + align, np.uint8)
        buffer = file_windows.placed(held, at, size)
        assert (buffer.ctypes.data - at) % align == 0
        buffer[:] = data[at - prefix : at - prefix + size]
        first, stop = -(-at // align), (at + size) // align  # its whole pages
        if (stop - first) * align >= file_windows.DIRECT_MIN:
            direct_pages[first:stop] = True
        pieces.append(buffer)
        keep.append(held)
        at += size
    starts = np.cumsum([prefix, *sizes[:-1]]).tolist()
    with file_windows.FileWindows() as files:
        fd = files.open(path)
        window = [(fd, start, buffer) for start, buffer in zip(starts, pieces, strict=True)]
        if order == "one window":
            assert files.write(window) == data.size
        else:
            for piece in reversed(window):
                files.write([piece])
        files.sync()
        assert files.direct_bytes == direct_pages.sum() * align > 0
    if filesystem_type(tmp_path) not in ("tmpfs", "ramfs"):  # whose data is the page cache
        cached = cached_pages(path)
        assert not cached[direct_pages].any()  # buffered, they would be in the cache after the sync
    assert path.read_bytes() == b"h" * prefix + data.tobytes()


def test_a_direct_write_the_kernel_refuses_is_written_through_the_cache(tmp_path, monkeypatch):
    """A filesystem may take O_DIRECT at open and refuse a write it cannot align (the kernel's
    EINVAL; forced here by lowering `ALIGN` to a byte, so a piece at an odd offset from an odd
    address qualifies): the piece and every later one go through the page cache, and land."""
    if reason := refuses_o_direct(tmp_path):
        pytest.skip(reason)
    path = tmp_path / "file.bin"
    path.write_bytes(b"")
    probe = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        os.pwrite(probe, np.zeros(4097, np.uint8)[1:], 1)
        pytest.skip(f"{tmp_path}'s filesystem takes unaligned O_DIRECT writes")
    except OSError as e:
        assert e.errno == errno.EINVAL
    finally:
        os.close(probe)
    monkeypatch.setattr(file_windows, "ALIGN", 1)
    monkeypatch.setattr(file_windows, "DIRECT_MIN", 1)
    data = np.random.default_rng(6).integers(0, 255, (2 << 20) + 3, dtype=np.uint8)
    with file_windows.FileWindows() as files:
        fd = files.open(path)
        files.write([(fd, 11, data[1 : 1 << 20])])
        files.write([(fd, 11 + (1 << 20) - 1, data[1 << 20 :])])
        files.sync()
        assert files.direct_bytes == 0
        assert files._direct == {fd: None}  # not tried again
    assert path.read_bytes() == bytes(11) + data[1:].tobytes()
