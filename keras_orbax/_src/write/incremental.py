"""Incremental saves: a shard file whose content has not changed since the previous committed step
of the same directory is a hard link to that step's file (in object storage: a server-side copy
of that step's object) instead of being written again.

A fine-tuning run (LoRA on a frozen backbone, a new head on a frozen encoder) changes a small part
of its state between saves; the frozen weights are most of the bytes. Buffer identity cannot tell
them apart: Keras's JAX trainer hands back a new array for every state variable each step, frozen
ones included (`tests/test_incremental.py` checks this). So each shard's content is fingerprinted
when it is written, the fingerprint recorded beside its CRCs in the step's checksum files
(`keras_orbax_checksums/process_<i>.json`, key `fingerprint`), and the next save compares against
the previous step's record:

- fingerprint: SHA-256 of a header naming the shard's layout (array shape, chunk, dtype, one file
  or not, sharding) followed by the shard's bytes, kept to its first 128 bits. Two different
  contents share one with probability 2**-128 per shard compared (docs/incremental.md);
- a shard is linked only if the previous step recorded the same file name with the same
  fingerprint, and its file there, once linked, is read and its CRC is the recorded one (CRC-32C
  where google-crc32c is installed and the step records it, else CRC-32): a
  file written into since (`cp -p` or `rsync -a --inplace` over the step keep its mtime; a write
  in the save's own clock tick looks unchanged) is not passed on, whatever its timestamps say. It
  then gets the recorded CRCs, so the new step's checksum file is complete and `verify` reads
  it as any other;
- with `rewrite_every=K`, a file already held by K steps is written again, not linked: two steps
  K or more saves apart share no file (each entry counts the steps holding its file, `shared`);
- in object storage (`gs://`, `s3://`) the check is not a time (S3 keeps them to the second)
  but the version the store gives an object at each write (S3 ETag, GCS generation): a save
  records each object's version after writing it (key `object_version`, one listing), and the
  next save asks the store to copy the object only if it is still at that version
  (`object_copy`), so a copy never carries an object written into since;
- anything else (no previous step, one written without fingerprints, an object without a
  recorded version, a link the filesystem or a copy the store refuses, a file gone or resized)
  writes the file in full.

Fingerprinting costs one SHA-256 pass over the bytes (about 1.6 GB/s a core), which a shard that
changes at every save (a full fine-tune) would pay for nothing. So each entry also counts the
saves in a row that wrote the shard (`written`), and a shard written at each of the last 2 to 15
saves is written again without a fingerprint; at 16 it is fingerprinted twice in a row (the first
to record, the second to compare), and so on every 16 saves. A shard that stops changing is
linked again within 17 saves; one that is linked is fingerprinted at every save. The rule only
decides whether to look: a file is linked only when two fingerprints over all of its bytes match.

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
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from keras_orbax._src.format import checksum, crc, step_dirs
from keras_orbax._src.format.step_record import STATE
from keras_orbax._src.storage import locations, object_copy

# The fingerprint's name in a checksum file: a step recorded with another (or none) is not compared.
ALGORITHM = "sha256-128"
ENTRY_KEY = "fingerprint"
WRITTEN_KEY = "written"  # saves in a row that wrote the shard, this one included (0: linked)
VERSION_KEY = "object_version"  # object storage: the object's ETag or generation once written
SHARED_KEY = "shared"  # steps holding this very file (link) or object (copy), this one included
_PROBE_EVERY = 16
_DIGEST_HEX = 32  # 128 bits

# Writes a shard; with `fingerprinted=True` its entry holds the fingerprint too, computed while the
# bytes are written (`shard_files.write_shard`).
WriteShard = Callable[..., tuple[str, Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class _Recorded:
    fingerprint: str | None  # None: written without looking (`fingerprinted_after`)
    crcs: dict[str, int]  # every CRC recorded (`crc.RECORDED` keys)
    nbytes: int
    written: int
    version: str | None = None  # object storage only
    shared: int = 1


def fingerprinted_after(written: int) -> bool:
    """Whether a shard written at each of the last `written` saves is fingerprinted at this one:
    always after 0 or 1 (linked, new, or changed once), then at 2 saves in a row of every
    `_PROBE_EVERY` (the first records, the second compares)."""
    return written < 2 or written % _PROBE_EVERY in (0, 1)


class Plan:
    """What one save compares its shards with: the previous committed step's recorded files
    (none: that step has no fingerprints, or there is no such step), a local directory or an
    object-store prefix (`gs://`, `s3://`); `rewrite_every`: how many steps may hold one file."""

    def __init__(
        self,
        previous_state: str | None,
        recorded: dict[str, _Recorded],
        rewrite_every: int | None = None,
    ) -> None:
        self.previous_state = previous_state
        self._recorded = recorded
        self._rewrite_every = rewrite_every
        self._remote = previous_state is not None and locations.is_remote(previous_state)

    def write_or_link(self, root: str, shard: Any, write: WriteShard) -> tuple[str, dict[str, Any]]:
        """Links `shard`'s file under `root` (a step's `state/`) to the previous step's (in object
        storage: copies it on the server), if that holds the same content, else writes it with
        `write`; returns its name and checksum entry (fingerprint included)."""
        relative = shard.relative
        recorded = self._recorded.get(relative)
        streak = 0 if recorded is None else recorded.written
        if not fingerprinted_after(streak):  # it changed at every recent save: write it
            name, entry = write(shard)
            return name, {**entry, WRITTEN_KEY: streak + 1}
        if recorded is None:  # nothing to compare with: fingerprinted as it is written, in cache
            name, entry = write(shard, fingerprinted=True)
            return name, {**entry, WRITTEN_KEY: streak + 1, SHARED_KEY: 1}
        digest = fingerprint(shard.layout, shard.data)
        if (
            recorded is not None
            and recorded.fingerprint == digest
            and (self._rewrite_every is None or recorded.shared < self._rewrite_every)
            and self._carry(relative, f"{root}/{relative}", recorded)
        ):
            return relative, {
                **recorded.crcs,
                "bytes": recorded.nbytes,
                ENTRY_KEY: digest,
                WRITTEN_KEY: 0,
                SHARED_KEY: recorded.shared + 1,
            }
        name, entry = write(shard)
        return name, {**entry, ENTRY_KEY: digest, WRITTEN_KEY: streak + 1, SHARED_KEY: 1}

    def _carry(self, relative: str, target: str, recorded: _Recorded) -> bool:
        """Puts the previous step's file at `target` without sending its bytes; whether it did."""
        if self._remote:
            return self._copy(relative, target, recorded)
        return self._link(relative, target, recorded)

    def _link(self, relative: str, target: str, recorded: _Recorded) -> bool:
        """Links the previous step's file at `target` if its bytes are the recorded ones.

        No timestamp can show that a file still holds what was recorded: `cp -p` and `rsync -a
        --inplace` keep the mtime of a file they write into, and timestamps are coarse (a write in
        the save's own tick looks older). So the linked file is read and its CRC (`crc.strongest`)
        compared with the recorded one; reading is far cheaper than writing and fsyncing it
        (docs/incremental.md). The link comes first: what is checked is the very inode the new step holds.
        """
        source = f"{self.previous_state}/{relative}"
        try:
            if os.stat(source).st_size != recorded.nbytes:
                return False  # resized since it was recorded: this step gets its own
            os.link(source, target)
        except OSError:  # gone (deleted meanwhile), or no hard links on this filesystem
            return False
        try:
            algorithm, value = crc.strongest(recorded.crcs)
            intact = checksum.file_crc(target, algorithm) == (recorded.nbytes, value)
        except OSError:
            intact = False
        if not intact:  # written into since: the step gets a file of its own, written afresh
            os.unlink(target)
        return intact

    def _copy(self, relative: str, target: str, recorded: _Recorded) -> bool:
        """A server-side copy of the previous step's object, only if it is still the very object
        recorded (its ETag or generation): none was recorded by a save older than this check."""
        if recorded.version is None:
            return False
        return object_copy.copy(f"{self.previous_state}/{relative}", target, recorded.version)


def record_versions(root: str, checksums: Mapping[str, dict[str, Any]]) -> None:
    """Adds to each of `checksums` (an object under `root`, just written or copied) its object's
    version, from one listing of `root`: the next save copies it only while it is still that
    object."""
    found = object_copy.versions(root)
    for name, entry in checksums.items():
        if name in found:
            entry[VERSION_KEY] = found[name]


def fingerprint(layout: str, data: np.ndarray) -> str:
    """128 bits of SHA-256 over `layout` and `data`'s bytes (C-contiguous). hashlib releases the
    GIL over large buffers, so the writer's threads fingerprint shards in parallel."""
    hasher = fingerprinter(layout)
    hasher.update(memoryview(data.reshape(-1).view(np.uint8).data))
    return fingerprint_of(hasher)


def fingerprinter(layout: str) -> Any:
    """A fingerprint begun: `update` it with the shard's bytes in order, then `fingerprint_of`."""
    return hashlib.sha256(layout.encode())


def fingerprint_of(hasher: Any) -> str:
    return str(hasher.hexdigest()[:_DIGEST_HEX])


@functools.lru_cache(maxsize=4096)
def layout_of(
    shape: tuple[int, ...], chunk: tuple[int, ...], dtype: np.dtype, sharding: Any, packed: bool
) -> str:
    """The header of a shard's fingerprint: a shard saved with another shape, chunk, dtype,
    sharding or file arrangement is a new shard, whatever its bytes."""
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
        return Plan(None, {}, rewrite_every)
    state = root.step_dir(earlier[-1]) / STATE
    return Plan(os.fspath(state), _recorded(state), rewrite_every)


def _recorded(state: Any) -> dict[str, _Recorded]:
    """Every process's recorded shard files of a step's `state/` with their fingerprints ({} for a
    step written without them, or whose checksum files cannot be read: a full save)."""
    found: dict[str, _Recorded] = {}
    for path in sorted((state / checksum.CHECKSUMS_DIR).glob("process_*.json")):
        try:
            content = json.loads(path.read_text())
            if (
                content.get(ENTRY_KEY) != ALGORITHM
                or content.get("algorithm") != checksum.ALGORITHM
            ):
                continue
            for name, entry in content["files"].items():
                if ENTRY_KEY in entry or WRITTEN_KEY in entry:
                    digest = entry.get(ENTRY_KEY)
                    found[name] = _Recorded(
                        None if digest is None else str(digest),
                        {k: int(entry[k]) for k in crc.KEYS if k in entry or k == crc.CRC32.key},
                        int(entry["bytes"]),
                        int(entry.get(WRITTEN_KEY, 0)),
                        None if VERSION_KEY not in entry else str(entry[VERSION_KEY]),
                        int(entry.get(SHARED_KEY, 1)),
                    )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable: its files are written again, and verify reports the step
    return found


_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar(
    "keras_orbax_incremental", default=None
)


@contextlib.contextmanager
def planned(plan: Plan | None) -> Iterator[None]:
    """Within it, a fast-format save compares its shards with `plan` (None: writes every file and
    records no fingerprints)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def active() -> Plan | None:
    """The plan of the save being started (`planned`)."""
    return _PLAN.get()
