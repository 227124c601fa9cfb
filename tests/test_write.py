"""keras-orbax writes the fast format's files itself: byte for byte what Orbax's own writer makes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keras_orbax import _save, _write


def _tree() -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "model"))

    def put(values: np.ndarray, *spec: str | None) -> jax.Array:
        return jax.device_put(values, NamedSharding(mesh, PartitionSpec(*spec)))

    rng = np.random.default_rng(0)
    return {
        "kernel": put(rng.standard_normal((16, 32), dtype=np.float32), "batch", "model"),
        "embed": {"table": put(rng.standard_normal((8, 16)).astype(jnp.bfloat16), None, "model")},
        "bias": put(np.arange(32, dtype=np.int32)),
        "seed": put(np.array([7, 9], dtype=np.uint32)),
        "mask": put(np.array([True, False, True, True]), "model"),
        "small": put(np.arange(-4, 4, dtype=np.int8), "model"),
        "half": put(np.ones((4, 8), dtype=np.float16), "batch"),
        "step": put(np.array(5, dtype=np.int64 if jax.config.x64_enabled else np.int32)),
    }


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and _write.CHECKSUMS_DIR not in p.parts
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_writer_makes_the_files_orbax_makes(tmp_path, blocking):
    tree = _tree()
    orbax_context = ocp.Context()
    for option, value in _save._FORMATS["fast"].items():
        setattr(orbax_context.array.saving, option, value)
    with ocp.training.Checkpointer(tmp_path / "orbax", context=orbax_context) as checkpointer:
        checkpointer.save_pytree(1, tree)
    with _save.open_checkpointer(tmp_path / "ours", "fast") as checkpointer:
        context = _write.shards_stay_unchanged() if blocking else _nullcontext()
        with context:
            response = checkpointer.save_async(1, tree)
        response.result()

    theirs, ours = (
        _files(tmp_path / "orbax" / "1" / "state"),
        _files(tmp_path / "ours" / "1" / "state"),
    )
    assert sorted(ours) == sorted(theirs)
    different = [name for name in theirs if theirs[name] != ours[name]]
    assert different == ["commit_success.txt"]  # it names the directory it was written in
    loaded = ocp.load(tmp_path / "ours" / "1", checkpointable_name="state")
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), loaded, tree)
    )
    meta = ocp.checkpointables_metadata(tmp_path / "ours" / "1")
    assert meta.metadata is not None


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()
