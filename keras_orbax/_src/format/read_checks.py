"""Checking the fast format's shard files against their recorded CRC (CRC-32C where google-crc32c
is installed and the step records it, else CRC-32: `crc.strongest`) over the bytes a restore
reads, as it reads them (`restore_sharded`'s `verify`), not in a second pass: each piece of
`PIECE_BYTES` is checksummed right after it is read, while it is still in the cache
(`read_in_pieces`; a second pass over a 32 MiB shard reads it back from memory).

A region that is one whole shard file is checked by the thread that read it (`whole`). A region
that cuts a file (a restore onto another layout) reads it in pieces, often shared among regions
and threads: each piece of at least `_PIECE_MIN_BYTES` is checksummed as it arrives, continuing
the CRC of the piece it follows (or joined to its neighbours with `Crc.combine` when it comes
out of order), so a file whose pieces cover it is checked without reading it again. A file read
whole in short runs is read back once the regions are read (`finish`), before anything is
assigned; one read in part (another process reads the rest) is read back only where the caller
asked for every byte to be checked (`read_back`, `verify=True`), else its array is reported
unchecked: each process reads only the bytes its devices need.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from keras_orbax._src.format import checksum
from keras_orbax._src.format.crc import Crc

# Smaller pieces are runs of a cut row: a CRC call and an entry each would cost more than reading
# the file again (`finish`).
_PIECE_MIN_BYTES = 4 << 10
PIECE_BYTES = 1 << 20  # read, then checksummed while in the cache (L2 holds it; 8 MiB would not)


def read_in_pieces(fd: int, out: memoryview, offset: int, algorithm: Crc | None) -> tuple[int, int]:
    """Reads `out` from byte `offset` of the file `fd`, `PIECE_BYTES` at a time, each piece's CRC
    (`algorithm`; None: none) computed right after it is read; (bytes read, CRC of them). Fewer
    bytes than `out` holds: the file ended.

    Raises:
        OSError: the file cannot be read.
    """
    crc, done, size = 0, 0, len(out)
    while done < size:
        piece = out[done : done + PIECE_BYTES]
        n = os.preadv(fd, [piece], offset + done)
        if n == 0:
            break
        if algorithm is not None:
            crc = algorithm.update(crc, piece[:n])
        done += n
    return done, crc


def _pieces(view: memoryview) -> list[tuple[int, memoryview]]:
    """`view` in pieces of `PIECE_BYTES`, a short tail joined to the piece before it (a piece
    under `_PIECE_MIN_BYTES` is not checksummed alone: its file would be read back)."""
    starts = list(range(0, len(view), PIECE_BYTES)) or [0]
    if len(starts) > 1 and len(view) - starts[-1] < _PIECE_MIN_BYTES:
        starts.pop()
    ends = [*starts[1:], len(view)]
    return [(a, view[a:b]) for a, b in zip(starts, ends, strict=True)]


class _File:
    """What has been read of one file's data: pieces (start -> end, CRC), joined when adjacent."""

    def __init__(self, key: str, path: Any, data_bytes: int, algorithm: Crc) -> None:
        self.key, self.path, self.data_bytes, self.algorithm = key, path, data_bytes, algorithm
        self.pieces: dict[int, tuple[int, int]] = {}
        self.ends: dict[int, int] = {}  # end -> start
        self.again = False  # some bytes not kept as a piece: read it back in `finish`
        self.nbytes_read = 0  # by this process, in pieces of any size
        self.lock = threading.Lock()

    def add(self, start: int, data: memoryview) -> None:
        """Notes `data`, read at `start`: a piece that follows one already read extends its CRC
        (reading in order, the common case, needs no `Crc.combine`)."""
        end = start + len(data)
        with self.lock:  # one file's: threads reading other files go on
            if start in self.pieces or end in self.ends:  # read twice: not a tiling
                self.again = True
                return
            left = self.ends.pop(start, None)
            if left is None:
                crc = self.algorithm.update(0, data)
            else:
                _, left_crc = self.pieces.pop(left)
                start, crc = left, self.algorithm.update(left_crc, data)
            right = self.pieces.pop(end, None)
            if right is not None:
                right_end, right_crc = right
                del self.ends[right_end]
                crc, end = self.algorithm.combine(crc, right_crc, right_end - end), right_end
            self.pieces[start] = (end, crc)
            self.ends[end] = start

    def data_crc(self) -> int | None:
        """The CRC of the whole data, if the pieces cover it exactly."""
        piece = self.pieces.get(0)
        if self.again or piece is None or piece[0] != self.data_bytes or len(self.pieces) != 1:
            return None
        return piece[1]


class ReadChecks:
    """The recorded checksums of one restore's shard files (`<array>/<chunk key>` -> the CRC to
    check and its value), and what has been read of the files regions cut."""

    def __init__(self, recorded: Mapping[str, tuple[Crc, int]], *, read_back: bool = False) -> None:
        self.recorded, self.read_back = recorded, read_back
        self.unchecked: dict[str, None] = {}  # keys of arrays with a file `finish` left unchecked
        self._files: dict[str, _File] = {}
        self._whole: set[str] = set()  # files checked whole (`whole`): `finish` skips them
        self._lock = threading.Lock()

    def whole(self, name: str, key: str, file: Callable[[], Any], *parts: Any) -> None:
        """Checks a file read whole: `parts` (buffers) are all its bytes, as read, in order;
        `file()` its path (for a message). A file with no recorded checksum costs no CRC.

        Raises:
            CorruptCheckpointError: naming the array and the file.
        """
        algorithm = self.algorithm(name)
        if algorithm is not None:
            self.compare(name, key, file, algorithm.of(*parts))

    def algorithm(self, name: str) -> Crc | None:
        """The CRC recorded for the file `name` (None: none is, nothing to compute)."""
        recorded = self.recorded.get(name)
        return None if recorded is None else recorded[0]

    def compare(self, name: str, key: str, file: Callable[[], Any], crc: int) -> None:
        """Checks `crc`, computed over every byte of the file `name` as it was read (by
        `algorithm(name)`), against the recorded one: the file is then checked whole.

        Raises:
            CorruptCheckpointError: naming the array and the file.
        """
        algorithm, value = self.recorded[name]
        if crc != value:
            raise checksum.mismatch(key, file(), crc, value, algorithm)
        self._whole.add(name)  # a set's `add` is atomic: no lock

    def fetching(
        self,
        name: str,
        key: str,
        path: Any,
        data_bytes: int,
        fetch: Callable,
        data_offset: int,
        local: bool = True,
    ) -> Callable:
        """`fetch` (a `byte_runs.Fetch`) of the file `name` (of array `key`, at `path`, holding
        `data_bytes` of data at `data_offset`), noting each piece of data it reads. A `local`
        file is fetched `PIECE_BYTES` at a time, each piece noted while still in the cache; in
        object storage every request of a call stays in flight together."""
        if name not in self.recorded:
            return fetch
        algorithm = self.recorded[name][0]
        with self._lock:
            file = self._files.setdefault(name, _File(key, path, data_bytes, algorithm))

        def note(requests: list[tuple[memoryview, int]]) -> None:
            for view, offset in requests:
                if data_offset <= offset and offset + len(view) <= data_offset + data_bytes:
                    self._piece(file, offset - data_offset, view)

        def checked(requests: list[tuple[memoryview, int]]) -> None:
            if not local:
                fetch(requests)
                note(requests)
                return
            batch: list[tuple[memoryview, int]] = []
            nbytes = 0
            for view, offset in requests:
                for start, piece in _pieces(view):
                    batch.append((piece, offset + start))
                    nbytes += len(piece)
                    if nbytes >= PIECE_BYTES:
                        fetch(batch)
                        note(batch)
                        batch, nbytes = [], 0
            if batch:
                fetch(batch)
                note(batch)

        return checked

    def _piece(self, file: _File, start: int, data: memoryview) -> None:
        file.nbytes_read += len(data)  # under the GIL: a count, not a check
        if len(data) < _PIECE_MIN_BYTES:
            file.again = True
        else:
            file.add(start, data)

    def finish(self) -> None:
        """Checks every file read in pieces from its pieces (their CRC extended with the plain shard
        index every keras-orbax file ends with). Where they do not cover it, it is read back if
        this process read all of it anyway (in runs too short to checksum one by one) or with
        `read_back`; else (it needs part of it) its array is listed in `unchecked`: each process
        reads only the bytes its devices need.

        Raises:
            CorruptCheckpointError: naming each array and file that failed.
        """
        problems, again = [], []
        io_error = None  # the cause of the error raised: an I/O error is retried, damage is not
        with self._lock:  # checked once: a later `finish` (one per array in `convert`) skips them
            files, self._files = self._files, {}
        for name, file in files.items():
            if name in self._whole:
                continue
            data_crc = file.data_crc()
            if data_crc is None:
                again.append((name, file))
                continue
            algorithm, recorded = self.recorded[name]
            crc = algorithm.update(data_crc, checksum.shard_index(file.data_bytes))
            if crc != recorded:
                problems.append(
                    checksum.mismatch_line(file.key, file.path, crc, recorded, algorithm)
                )
        # Read back where every byte was needed anyway (only in short runs), or asked for.
        again, partly = (
            [(n, f) for n, f in again if self.read_back or f.nbytes_read >= f.data_bytes],
            [f for _, f in again if not (self.read_back or f.nbytes_read >= f.data_bytes)],
        )
        for name, file in again:
            algorithm, recorded = self.recorded[name]
            problem, _, crc = checksum.check_file(file.path, file.data_bytes, algorithm)
            if isinstance(problem, checksum.Unreadable):
                io_error = io_error or problem.error
            if problem is not None:
                problems.append(f"{file.key}: {file.path}: {problem}")
            elif crc != recorded:
                problems.append(
                    checksum.mismatch_line(file.key, file.path, crc, recorded, algorithm)
                )
        self.unchecked.update((file.key, None) for file in partly)
        if problems:
            raise checksum.damaged(problems) from io_error
