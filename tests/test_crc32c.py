"""CRC-32C: where google-crc32c is installed, a save records a CRC-32C beside each shard file's
CRC-32 and every check (a restore in each read shape, an incremental save's link) uses it; where it
is not installed, the CRC-32 is recorded and checked, on steps saved with or without it."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import crc
from keras_orbax.errors import CorruptCheckpointError
from tests import _models
from tests._harness import WORKERS_DIR, run_workers
from tests.workers import crc_checks

pytest.importorskip("google_crc32c")
CHECKSUMS = "state/keras_orbax_checksums/process_0.json"


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _entries(step_dir) -> dict:
    return json.loads((step_dir / CHECKSUMS).read_text())["files"]


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
def test_combine_joins_the_crcs_of_two_pieces(algorithm):
    """A restore onto another layout joins pieces that arrive out of order with `combine`."""
    algorithm = crc.CRC32 if algorithm == "crc32" else crc.CRC32C
    data = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8).tobytes()
    import google_crc32c

    whole = zlib.crc32(data) if algorithm is crc.CRC32 else google_crc32c.value(data)
    assert algorithm.of(data) == whole
    for cut in (0, 1, 4096, 65_537, len(data)):
        a, b = data[:cut], data[cut:]
        assert algorithm.combine(algorithm.of(a), algorithm.of(b), len(b)) == whole


@pytest.mark.parametrize("library", ["google-crc32c", "isal"])
def test_each_library_extends_the_same_crc32c_over_any_buffer(library):
    """google-crc32c's and ISA-L's paths (through ctypes, or a copy below their thresholds) give
    google-crc32c's own value at every length around the thresholds and every cut, on every
    kind of buffer a restore hands them, read-only ones included."""
    import google_crc32c

    from keras_orbax._src.compat import crc32c_compat

    extend, copied = crc32c_compat._google()
    if library == "isal":
        pytest.importorskip("isal")
        extend = crc32c_compat._isal(copied)
    assert extend is not None
    data = np.random.default_rng(3).integers(0, 256, (1 << 20) + 4099, dtype=np.uint8)
    lengths = (0, 1, 7, 4095, 16 << 10, (16 << 10) + 1, 256 << 10, (256 << 10) - 1, data.size)
    for n in lengths:
        expected = google_crc32c.value(data[:n].tobytes())
        for buffer in (data[:n], memoryview(data)[:n].toreadonly(), bytes(data[:n])):
            assert extend(0, buffer) == expected, (library, n)
        # A region's own buffer: a writable memoryview of float32 items (its length in items).
        words = data[: n - n % 4].view(np.float32).data
        assert extend(0, words) == google_crc32c.value(data[: n - n % 4].tobytes()), (library, n)
        for cut in (1, n // 3, n - 5):
            if 0 <= cut <= n:
                head = extend(0, memoryview(data)[:cut])
                assert extend(head, memoryview(data)[cut:n]) == expected, (library, n, cut)


def test_isal_extends_zlibs_crc32_over_any_buffer():
    """ISA-L's CRC-32 (`crc.CRC32` where isal is installed) is zlib's at every length around its
    threshold, from any starting value, on every kind of buffer."""
    pytest.importorskip("isal")
    from keras_orbax._src.compat import crc32_compat

    assert crc32_compat.extend is not None and crc.CRC32.update is crc32_compat.extend
    data = np.random.default_rng(4).integers(0, 256, (1 << 20) + 4099, dtype=np.uint8)
    for n in (0, 1, 7, (16 << 10) - 1, 16 << 10, 100_000, data.size):
        for start in (0, 12345, 0xFFFFFFFF):
            expected = zlib.crc32(data[:n].tobytes(), start)
            for buffer in (data[:n], memoryview(data)[:n].toreadonly(), bytes(data[:n])):
                assert crc32_compat.extend(start, buffer) == expected, (n, start)
            words = data[: n - n % 4].view(np.float32).data  # a writable view of float32 items
            expected = zlib.crc32(data[: n - n % 4].tobytes(), start)
            assert crc32_compat.extend(start, words) == expected, (n, start)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """`mlp` and `embed` saved with google-crc32c installed, and copies with one byte flipped."""
    import keras

    root = tmp_path_factory.mktemp("crc")
    model = crc_checks.model_for("whole")
    _models.fill_arange(model)
    keras_orbax.save(model, root / "mlp", step=1)
    embed = crc_checks.embedding(("model", None))
    embed.weights[0].assign(np.random.default_rng(0).random((2048, 256)).astype("float32"))
    keras_orbax.save(embed, root / "embed", step=1)
    keras.distribution.set_distribution(None)
    for name, file, at in (
        ("mlp", f"{crc_checks.KERNEL.replace('/', '.')}/c.0.0", 7),
        ("embed", "layers.embedding.vars.0/c/3/0", 1000),
    ):
        shutil.copytree(root / name, root / f"{name}_damaged")
        _flip(root / f"{name}_damaged/1/state" / file, at)
    return root


def _recorded(steps, name: str, key: str) -> int:
    files = {**_entries(steps / "mlp/1"), **_entries(steps / "embed/1")}
    file = f"{crc_checks.KERNEL.replace('/', '.')}/c.0.0" if name == "mlp" else name
    return files[file][key]


def test_a_save_records_both_and_restores_check_the_crc32c(steps, distribution):
    for entry in {**_entries(steps / "mlp/1"), **_entries(steps / "embed/1")}.values():
        assert {"crc32", "crc32c", "bytes"} <= set(entry)
    messages = crc_checks.messages(steps)
    recorded = {
        "whole": _recorded(steps, "mlp", "crc32c"),
        "saved layout": _recorded(steps, "layers.embedding.vars.0/c/3/0", "crc32c"),
        "another layout": _recorded(steps, "layers.embedding.vars.0/c/3/0", "crc32c"),
    }
    for shape, message in messages.items():
        assert f"recorded {recorded[shape]:#010x} (CRC-32C)" in message, (shape, message)


@pytest.mark.parametrize("library", ["google-crc32c", "isal"])
def test_each_library_catches_a_flipped_byte_in_every_read_shape(
    steps, distribution, monkeypatch, library
):
    """Whichever library computes the CRC-32C, every read shape checks it and names the file."""
    import dataclasses

    from keras_orbax._src.compat import crc32c_compat

    extend, copied = crc32c_compat._google()
    if library == "isal":
        pytest.importorskip("isal")
        extend = crc32c_compat._isal(copied)
    assert crc.CRC32C is not None and extend is not None
    monkeypatch.setattr(crc, "CRC32C", dataclasses.replace(crc.CRC32C, update=extend))
    for shape, message in crc_checks.messages(steps).items():
        name = "mlp" if shape == "whole" else "layers.embedding.vars.0/c/3/0"
        assert f"recorded {_recorded(steps, name, 'crc32c'):#010x} (CRC-32C)" in message, shape


def test_without_google_crc32c_the_crc32_is_recorded_and_checked(steps):
    """A process where google-crc32c is not installed checks the CRC-32 of steps saved with it in
    every read shape, records only the CRC-32, and links unchanged files by their CRC-32."""
    [result] = run_workers(WORKERS_DIR / "crc_checks.py", 1, 8, {"root": str(steps)}, 300)
    assert result["crc32c"] is False
    for shape, message in result["messages"].items():
        name = "mlp" if shape == "whole" else "layers.embedding.vars.0/c/3/0"
        recorded = _recorded(steps, name, "crc32")
        assert f"recorded {recorded:#010x} (CRC-32)" in message, (shape, message)
    assert result["unverified"] == [[], []]
    saved = steps / "saved_without"
    for step in (1, 2):
        assert all(
            set(e) >= {"crc32"} and "crc32c" not in e for e in _entries(saved / f"{step}").values()
        )
    shard = "state/layers.embedding.vars.0/c/5/0"
    assert os.path.samefile(saved / "1" / shard, saved / "2" / shard)  # linked by its CRC-32


def test_a_step_without_crc32c_is_checked_by_its_crc32(steps, distribution):
    """Read where google-crc32c is installed, a file that records only a CRC-32 (saved without it,
    or linked from such a step) is checked by that."""
    directory = steps / "crc32_only"
    shutil.copytree(steps / "embed", directory)
    content = json.loads((directory / "1" / CHECKSUMS).read_text())
    for entry in content["files"].values():
        del entry["crc32c"]
    (directory / "1" / CHECKSUMS).write_text(json.dumps(content))
    _flip(directory / "1/state/layers.embedding.vars.0/c/3/0", 1000)
    for axes in (("model", None), (None, "model")):
        with pytest.raises(CorruptCheckpointError, match=re.escape("(CRC-32)")):
            keras_orbax.restore_sharded(crc_checks.embedding(axes), directory)


def test_an_incremental_link_is_checked_by_the_crc32c(tmp_path, distribution):
    """A shard is a link candidate when the CRC-32C of the model's bytes is the recorded one: a
    wrong CRC-32C recorded keeps it from being linked, a wrong CRC-32 (not the one compared) does
    not (the link is then proven by comparing the bytes), and the new step records the right one."""
    model = crc_checks.embedding(("model", None))
    keras_orbax.save(model, tmp_path, step=1)
    checksums = tmp_path / "1" / CHECKSUMS
    content = json.loads(checksums.read_text())
    wrong_crc32 = "layers.embedding.vars.0/c/1/0"
    wrong_crc32c = "layers.embedding.vars.0/c/2/0"
    right_crc32 = content["files"][wrong_crc32]["crc32"]
    content["files"][wrong_crc32]["crc32"] ^= 1
    content["files"][wrong_crc32c]["crc32c"] ^= 1
    checksums.write_text(json.dumps(content))
    keras_orbax.save(model, tmp_path, step=2)
    state1, state2 = tmp_path / "1/state", tmp_path / "2/state"
    assert os.path.samefile(state1 / wrong_crc32, state2 / wrong_crc32)
    assert not os.path.samefile(state1 / wrong_crc32c, state2 / wrong_crc32c)
    # the linked file's CRC-32 is computed from its bytes, not carried on from the wrong record
    linked = json.loads((tmp_path / "2" / CHECKSUMS).read_text())["files"][wrong_crc32]
    assert linked["crc32"] == right_crc32
