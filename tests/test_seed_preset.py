"""benchmarks/_seed_preset.py: a keras-hub Gemma2 preset written without holding the model is, file
for file, what keras-hub's own `save_to_preset` writes for the same config (values aside), and
keras-hub's own `from_preset` loads it."""

from __future__ import annotations

import json
import sys
import tracemalloc

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest

from tests._harness import REPO_ROOT
from tests._hub import import_keras_hub

keras_hub = import_keras_hub()
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import _seed_preset as seed  # noqa: E402

SMALL = dict(
    vocabulary_size=1000,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=16,
    **seed.GEMMA2_ARGS,
)


def _h5_tree(path) -> dict:
    """Every group and dataset of an h5 file: kind, shape, h5 type, layout, attributes."""
    tree = {}

    def visit(name, obj):
        entry = {"kind": type(obj).__name__, "attrs": dict(obj.attrs)}
        if isinstance(obj, h5py.Dataset):
            entry.update(shape=obj.shape, chunks=obj.chunks, compression=obj.compression)
            entry["type"] = obj.id.get_type()  # compared with H5Tequal: class, size, tag
        tree[name] = entry

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        tree["/"] = {"kind": "File", "attrs": dict(f.attrs)}
    return tree


@pytest.mark.parametrize("max_shard_size", [10, 0.0002], ids=["one_file", "sharded"])
def test_synthesized_preset_is_what_save_to_preset_writes(tmp_path, max_shard_size):
    # Auto-named layers (`dropout_3`) are named in the h5 groups' attributes from a per-process
    # counter: each model is built from a cleared session, as a fresh process builds it.
    keras.backend.clear_session()
    keras_hub.models.GemmaBackbone(**SMALL).save_to_preset(
        str(tmp_path / "keras_hub"), max_shard_size=max_shard_size
    )
    keras.backend.clear_session()
    made = seed.make(tmp_path / "made", SMALL, max_shard_size=max_shard_size)
    want_files = sorted(p.name for p in (tmp_path / "keras_hub").iterdir())
    assert made["files"] == want_files
    assert made["sharded"] == (max_shard_size < 1)
    h5_files = [name for name in want_files if name.endswith(".h5")]
    assert len(h5_files) == (1 if max_shard_size > 1 else 2)  # 0.23 MB in 0.21 MB parts
    for name in h5_files:
        got, want = _h5_tree(tmp_path / "made" / name), _h5_tree(tmp_path / "keras_hub" / name)
        assert sorted(got) == sorted(want), name
        for key in want:
            assert got[key] == want[key], f"{name}: {key}"
    for name in ("config.json", *[n for n in want_files if n.endswith(".weights.json")]):
        got = json.loads((tmp_path / "made" / name).read_text())
        assert got == json.loads((tmp_path / "keras_hub" / name).read_text()), name
    got = json.loads((tmp_path / "made" / "metadata.json").read_text())
    want = json.loads((tmp_path / "keras_hub" / "metadata.json").read_text())
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k != "date_saved"} == {
        k: v for k, v in want.items() if k != "date_saved"
    }
    assert made["bytes"] == sum(
        np.prod(w.shape) * 2 for w in keras_hub.models.GemmaBackbone(**SMALL).weights
    )


@pytest.mark.parametrize("max_shard_size", [10, 0.0002], ids=["one_file", "sharded"])
def test_keras_hub_loads_the_synthesized_preset(tmp_path, max_shard_size):
    seed.make(tmp_path, SMALL, max_shard_size=max_shard_size)
    model = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path), dtype="bfloat16")
    embedding = np.asarray(model.get_layer("token_embedding").embeddings.value, np.float32)
    name = "model.weights.h5" if max_shard_size > 1 else "model_00000.weights.h5"
    with h5py.File(tmp_path / name, "r") as f:
        stored = f["layers/reversible_embedding/vars/0"][...].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(embedding, stored.astype(np.float32))
    magnitudes = np.abs(embedding)
    assert magnitudes.min() >= 2**-10 and magnitudes.max() < 2**-6
    assert len(np.unique(embedding)) > 1000 and (embedding < 0).any()
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    hidden = model.predict({"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, verbose=0)
    assert hidden.shape == (2, 8, SMALL["hidden_dim"]) and np.isfinite(hidden).all()


def test_values_are_the_same_whatever_the_window(tmp_path):
    seed.make(tmp_path / "a", SMALL, window_bytes=1000)  # the embedding: 128 B rows, 7 per block
    seed.make(tmp_path / "b", SMALL)
    a = h5py.File(tmp_path / "a" / "model.weights.h5")
    b = h5py.File(tmp_path / "b" / "model.weights.h5")
    with a, b:
        names: list[str] = []
        a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) == 24
        for name in names:
            np.testing.assert_array_equal(a[name][...], b[name][...], name)
        # Seeded by the dataset's name: two layers' kernels of one shape differ.
        first, second = (f"layers/gemma_decoder_block{s}/ffw_linear/vars/0" for s in ("", "_1"))
        assert not np.array_equal(a[first][...], a[second][...])


def test_make_holds_one_window_not_the_model(tmp_path):
    # A 4 MiB embedding written in 256 KiB windows: numpy never holds a whole variable.
    config = dict(SMALL, vocabulary_size=32768)
    tracemalloc.start()
    try:
        seed.make(tmp_path, config, window_bytes=256 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak
