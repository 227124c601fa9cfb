"""Incremental saves: a shard file whose content has not changed since the previous committed step
of the same directory is a hard link to that step's file (in object storage: a server-side copy
of that step's object) instead of being written again.

A fine-tuning run (LoRA on a frozen backbone, a new head on a frozen encoder) changes a small part
of its state between saves; the frozen weights are most of the bytes. Buffer identity cannot tell
them apart: Keras's JAX trainer hands back a new array for every state variable each step, frozen
ones included (`tests/test_incremental.py` checks this). So each save compares every shard with
the previous step's record of it (its checksum files, `keras_orbax_checksums/process_<i>.json`):

- layout: each entry names the shard's layout (array shape, chunk, dtype, one file or not,
  sharding; `layout_of`, the text itself, each distinct one once in the file's `layouts`); a
  shard saved with another layout is a new shard, whatever its bytes;
- candidate: the previous step recorded the same file name, layout and size, and the CRC of the
  model's bytes for it (CRC-32C where google-crc32c is installed and the step records it, else
  CRC-32; the CRC the file's entry needs anyway) is the recorded one;
- proof: the candidate is linked, then the linked file is read and its bytes compared with the
  model's, piece by piece (`_holds`): equal, it is kept, its CRCs computed from those bytes, so
  the new step's checksum file is complete and `verify` reads it as any other; anything else (a CRC
  collision, a file written into since, whatever its timestamps say: `cp -p` and
  `rsync -a --inplace` keep the mtime of a file they write into) unlinks it and writes the shard.
  No hash stands in for the bytes, so no probability either;
- with `rewrite_every=K`, a file already held by K steps is written again, not linked: two steps
  K or more saves apart share no file (each entry counts the steps holding its file, `shared`);
- in object storage (`gs://`, `s3://`) a save records each object's version after writing it
  (S3 ETag, GCS generation; key `object_version`, one listing), and the next save asks the store
  to copy a candidate's object only if it is still at that version (`object_copy`), then reads
  the copy back and compares it as on a disk (a download in place of an upload);
- anything else (no previous step, one written without layouts, an object without a recorded
  version, a link the filesystem or a copy the store refuses, a file gone or resized) writes the
  file in full.

A shard that is written pays nothing beyond its CRCs: a candidate's CRC, computed before the
decision, is handed to the write, which then computes only the others (`shard_files`). A shard
that had changed at this process's previous save (a trained variable's) is written first, its
CRCs taken while each piece is in cache, and linked instead only where its CRC then matches the
record (and its bytes the linked file's): its bytes are read once, not twice. What a link costs
instead of a write and an fsync is reading the file once (docs/incremental.md).

Hard links and copies keep every step self-contained: deleting any other step (retention,
`rm -r`) leaves the linked file's inode, or the copied object, with this step. Nothing writes a
committed step's files again, so the sharing is invisible to readers (Orbax, tensorstore,
keras-orbax).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from keras_orbax._src.format import checksum, crc, step_dirs
from keras_orbax._src.format.step_record import STATE
from keras_orbax._src.storage import locations, object_copy

LAYOUTS_KEY = "layouts"  # a checksum file's distinct layouts: a step without them is not compared
LAYOUT_KEY = "layout"  # an entry's layout: during a save its text, in the file its index
VERSION_KEY = "object_version"  # object storage: the object's ETag or generation once written
SHARED_KEY = "shared"  # steps holding this very file (link) or object (copy), this one included
_COMPARE_BYTES = 1 << 20  # a piece of the file read back and compared while in cache

# Writes a shard (`shard_files.write_shard`); `known`: CRCs of its file computed already.
WriteShard = Callable[..., tuple[str, Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class _Recorded:
    layout: str
    crcs: dict[str, int]  # the CRCs its entry records, by `crc.KEYS` key
    nbytes: int
    version: str | None = None  # object storage only
    shared: int = 1


class Plan:
    """What one save compares its shards with: the previous committed step's recorded files
    (none: that step has no layouts recorded, or there is no such step), a local directory or an
    object-store prefix (`gs://`, `s3://`); `rewrite_every`: how many steps may hold one file."""

    def __init__(
        self,
        previous_state: str | None,
        recorded: dict[str, _Recorded],
        rewrite_every: int | None = None,
        changed_before: frozenset[str] = frozenset(),
    ) -> None:
        self.previous_state = previous_state
        self._recorded = recorded
        self._rewrite_every = rewrite_every
        self._remote = previous_state is not None and locations.is_remote(previous_state)
        # The shards whose bytes differed from their candidate's when the previous step was saved
        # by this process (`_changed`), and those of this save, for the next.
        self._changed_before = changed_before
        self.changed: set[str] = set()

    def write_or_link(
        self,
        root: str,
        shard: Any,
        write: WriteShard,
        algorithms: Sequence[crc.Crc] = crc.RECORDED,
    ) -> tuple[str, dict[str, Any]]:
        """Links `shard`'s file under `root` (a step's `state/`) to the previous step's (in object
        storage: copies it on the server), if that holds the very same bytes, else writes it with
        `write`; returns its name and checksum entry (layout included, the CRCs of `algorithms`)."""
        relative = shard.relative
        recorded = self._recorded.get(relative)
        fresh = {LAYOUT_KEY: shard.layout, SHARED_KEY: 1}
        parts = shard_bytes(shard)
        if (
            recorded is None
            or recorded.layout != shard.layout
            or recorded.nbytes != sum(len(p) for p in parts)
            or (self._rewrite_every is not None and recorded.shared >= self._rewrite_every)
        ):
            name, entry = write(shard)
            return name, {**entry, **fresh}
        algorithm, value = crc.strongest(recorded.crcs)
        if relative in self._changed_before and not self._remote:
            # It changed at the previous save too (a trained variable's): written first, its
            # CRCs taken while each piece is in cache, rather than read for the candidate's CRC
            # and again for the write. Linked instead where the CRC matches after all.
            name, entry = write(shard)
            computed = entry.get(algorithm.key)
            if computed != value:
                self.changed.add(relative)
                return name, {**entry, **fresh}
            os.unlink(f"{root}/{relative}")
        else:
            computed = algorithm.of(*parts)  # needed by the write if it is not linked
        # The other CRCs from the bytes as they are compared, not carried over: a record wrong in
        # one the candidate test did not use (a reader without CRC-32C checks the CRC-32) is not
        # passed on.
        others = [c for c in algorithms if c is not algorithm]
        carried = (
            self._carry(relative, f"{root}/{relative}", recorded, parts, others)
            if computed == value
            else None
        )
        if carried is not None:
            crcs = {**carried, algorithm.key: computed}
            return relative, {
                **{c.key: crcs[c.key] for c in algorithms},
                "bytes": recorded.nbytes,
                LAYOUT_KEY: shard.layout,
                SHARED_KEY: recorded.shared + 1,
            }
        if computed != value:
            self.changed.add(relative)
        name, entry = write(shard, known={algorithm.key: computed})
        return name, {**entry, **fresh}

    def _carry(
        self, relative: str, target: str, recorded: _Recorded, parts: Parts, crcs: list[crc.Crc]
    ) -> dict[str, int] | None:
        """Puts the previous step's file at `target` without sending its bytes, if it holds
        `parts`; the `crcs` of its bytes if it did, else None."""
        if self._remote:
            return self._copy(relative, target, recorded, parts, crcs)
        return self._link(relative, target, recorded, parts, crcs)

    def _link(
        self, relative: str, target: str, recorded: _Recorded, parts: Parts, crcs: list[crc.Crc]
    ) -> dict[str, int] | None:
        """Links the previous step's file at `target` if its bytes are `parts` (`_carry`).

        No timestamp can show that a file still holds what was recorded, and equal CRCs do not
        prove equal bytes: the linked file is read and compared with the model's bytes; reading
        is far cheaper than writing and fsyncing it (docs/incremental.md). The link comes first:
        what is compared is the very inode the new step holds.
        """
        source = f"{self.previous_state}/{relative}"
        try:
            if os.stat(source).st_size != recorded.nbytes:
                return None  # resized since it was recorded: this step gets its own
            os.link(source, target)
        except OSError:  # gone (deleted meanwhile), or no hard links on this filesystem
            return None
        try:
            with open(target, "rb", buffering=0) as handle:
                same = _holds(handle, parts, crcs)
        except OSError:
            same = None
        if same is None:  # the step gets a file of its own, never written through the link
            os.unlink(target)
        return same

    def _copy(
        self, relative: str, target: str, recorded: _Recorded, parts: Parts, crcs: list[crc.Crc]
    ) -> dict[str, int] | None:
        """A server-side copy of the previous step's object, only if it is still the very object
        recorded (its ETag or generation: none was recorded by a save older than this check),
        read back and compared with `parts`. A copy with other bytes is left for the write to
        replace."""
        if recorded.version is None:
            return None
        if not object_copy.copy(f"{self.previous_state}/{relative}", target, recorded.version):
            return None
        try:
            with locations.as_path(target).open("rb") as handle:
                return _holds(handle, parts, crcs)
        except Exception:  # the stores' clients raise their own types: the shard is written
            return None


Parts = tuple[memoryview, memoryview]  # a shard file's bytes: its data, then its zarr index


def shard_bytes(shard: Any) -> Parts:
    """The bytes of `shard`'s file: its data (C order), then its zarr shard index."""
    view = memoryview(shard.data.reshape(-1).view(np.uint8).data)
    return view, memoryview(checksum.shard_index(len(view)))


def _holds(handle: Any, parts: Parts, crcs: list[crc.Crc]) -> dict[str, int] | None:
    """The `crcs` of the file read from `handle` if it is exactly `parts`, one after another,
    else None (compared a piece at a time, `bytearray == memoryview` being one `memcmp`, and
    each equal piece's CRCs computed while it is in cache)."""
    block = bytearray(_COMPARE_BYTES)
    values = [0] * len(crcs)
    for part in parts:
        for start in range(0, len(part), _COMPARE_BYTES):
            piece = part[start : start + _COMPARE_BYTES]
            got = block if len(piece) == len(block) else bytearray(len(piece))
            if _read_into(handle, got) != len(got) or got != piece:
                return None
            values = [c.update(v, piece) for c, v in zip(crcs, values, strict=True)]
    if handle.read(1):  # more after them
        return None
    return {c.key: v for c, v in zip(crcs, values, strict=True)}


def _read_into(handle: Any, buffer: bytearray) -> int:
    """Fills `buffer` from `handle` (short only at the end of the file); how many bytes."""
    view, done = memoryview(buffer), 0
    while done < len(buffer):
        if hasattr(handle, "readinto"):
            n = handle.readinto(view[done:])
        else:  # a store's file object without it
            got = handle.read(len(buffer) - done)
            n = len(got)
            view[done : done + n] = got
        if not n:
            break
        done += n
    return done


def record_versions(root: str, checksums: Mapping[str, dict[str, Any]]) -> None:
    """Adds to each of `checksums` (an object under `root`, just written or copied) its object's
    version, from one listing of `root`: the next save copies it only while it is still that
    object."""
    found = object_copy.versions(root)
    for name, entry in checksums.items():
        if name in found:
            entry[VERSION_KEY] = found[name]


@functools.lru_cache(maxsize=4096)
def layout_of(
    shape: tuple[int, ...], chunk: tuple[int, ...], dtype: np.dtype, sharding: Any, packed: bool
) -> str:
    """A shard's layout, compared as text with the previous step's: a shard saved with another
    shape, chunk, dtype, sharding or file arrangement is a new shard, whatever its bytes."""
    described = _sharding_text(sharding)
    return f"keras-orbax shard v1|{shape}|{chunk}|{dtype.name}|{int(packed)}|{described}\n"


def _sharding_text(sharding: Any) -> str:
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:  # NamedSharding: axes, their sizes and the spec
        return f"{type(sharding).__name__}{dict(mesh.shape)}{tuple(spec)}"
    return repr(sharding)


def plan_for(directory: Any, step: int, rewrite_every: int | None = None) -> Plan:
    """The plan of a save of `step` to `directory`: compared with the latest committed step before
    it. With `rewrite_every=K`, a file held by K steps already is written again."""
    root = step_dirs.CheckpointRoot.of(directory)  # a caller's root: its listing reused
    earlier = [s for s in root.steps() if s < step]
    if not earlier:
        plan = Plan(None, {}, rewrite_every)
    else:
        state = root.step_dir(earlier[-1]) / STATE
        with _changed_lock:
            changed = _changed.pop(os.fspath(state), set())
        plan = Plan(os.fspath(state), _recorded(state), rewrite_every, frozenset(changed))
    with _changed_lock:  # the local and persistent tiers plan in their own threads
        _changed[os.fspath(root.step_dir(step) / STATE)] = plan.changed
        while len(_changed) > _CHANGED_KEPT:  # saves that never committed, or no save followed
            _changed.pop(next(iter(_changed)))
    return plan


# What each save of this process found changed (`Plan.changed`), by the step's final `state/`,
# for the next save compared with that step: a guess of which shards will change again, never a
# reason to link (a link is only ever made after the bytes are compared).
_changed: dict[str, set[str]] = {}
_changed_lock = threading.Lock()
_CHANGED_KEPT = 16


def _recorded(state: Any) -> dict[str, _Recorded]:
    """Every process's recorded shard files of a step's `state/` with their layouts ({} for a
    step written without them, or whose checksum files cannot be read: a full save)."""
    found: dict[str, _Recorded] = {}
    for path in sorted((state / checksum.CHECKSUMS_DIR).glob("process_*.json")):
        try:
            content = json.loads(path.read_text())
            layouts = content.get(LAYOUTS_KEY)
            if not isinstance(layouts, list) or content.get("algorithm") != checksum.ALGORITHM:
                continue  # an older step (a SHA-256 fingerprint, or none): written in full
            for name, entry in content["files"].items():
                crcs = {k: int(entry[k]) for k in crc.KEYS if k in entry}
                # A local step records one CRC (`crc.LOCAL`): compared where this process has it.
                if LAYOUT_KEY in entry and any(c.key in crcs for c in crc.RECORDED):
                    found[name] = _Recorded(
                        str(layouts[int(entry[LAYOUT_KEY])]),
                        crcs,
                        int(entry["bytes"]),
                        None if VERSION_KEY not in entry else str(entry[VERSION_KEY]),
                        int(entry.get(SHARED_KEY, 1)),
                    )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            continue  # unreadable: its files are written again, and verify reports the step
    return found


def recorded_json(checksums: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What an incremental save's checksum file holds beside `algorithm`: its entries with each
    layout's text replaced by its index in `layouts`, listed once."""
    layouts: dict[str, int] = {}
    files = {}
    for name, entry in checksums.items():
        layout = entry.get(LAYOUT_KEY)
        if isinstance(layout, str):
            entry = {**entry, LAYOUT_KEY: layouts.setdefault(layout, len(layouts))}
        files[name] = entry
    return {LAYOUTS_KEY: list(layouts), "files": files}


_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar(
    "keras_orbax_incremental", default=None
)


@contextlib.contextmanager
def planned(plan: Plan | None) -> Iterator[None]:
    """Within it, a fast-format save compares its shards with `plan` (None: writes every file and
    records no layouts)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def active() -> Plan | None:
    """The plan of the save being started (`planned`)."""
    return _PLAN.get()
