"""`keras_orbax.save_to_preset`: a sharded keras-hub model written as keras-hub's own preset.

The oracle is keras-hub: the files equal what its `save_to_preset` writes (h5 datasets and attributes,
config, metadata but its date), and its `from_preset` reads back exactly the model's values. The
round trip of issue 27: a tiny Gemma loaded sharded with `keras_orbax.from_preset` on a (2, 4) mesh,
trained one step, written back, reloaded by keras-hub.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.export.export_checksums import SIDECAR
from keras_orbax.errors import CorruptCheckpointError
from tests._hub import TINY_GEMMA, import_keras_hub
from tests.test_export_h5 import _dataset_names, flip_byte, h5_contents

keras_hub = import_keras_hub()


def _tokens(batch: int = 8, length: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(1, TINY_GEMMA["vocabulary_size"], (batch, length)).astype(
            "int32"
        ),
        "padding_mask": np.ones((batch, length), "int32"),
    }


def _same_preset_files(ours: Path, theirs: Path, *, same_model: bool = True) -> None:
    """The same files (and keras-orbax's checksums, which `verify` checks), the weights with the
    same datasets and attributes, the same JSON (but the date `metadata.json` records). Of another instance of the model (`same_model=False`), the
    groups' `name` attributes and the config's `name` differ (Keras numbers each layer's name per
    process: `dropout_3`)."""
    listed = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == sorted([*listed, SIDECAR])
    verified = keras_orbax.verify(ours)  # the sidecar's CRCs: every backbone dataset checked
    assert verified.intact and verified.checksummed > 0 and verified.unchecked == (), verified
    for path in sorted(theirs.iterdir()):
        if path.name.endswith(".h5"):
            got, expected = h5_contents(ours / path.name), h5_contents(path)
            if not same_model:
                got, expected = (
                    {n: e for n, e in c.items() if "data" in e} for c in (got, expected)
                )
            assert got == expected, path.name
        elif path.name.endswith(".json"):
            expected, got = json.loads(path.read_text()), json.loads((ours / path.name).read_text())
            if path.name == "metadata.json":
                expected.pop("date_saved"), got.pop("date_saved")
            if not same_model and path.name == "config.json":  # and so is the model's
                expected["config"].pop("name"), got["config"].pop("name")
            assert got == expected, path.name


def _mesh_distribution(shape: tuple[int, int]) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"))
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_round_trip_sharded_gemma_trained_one_step(tmp_path, distribution, lora):
    """With LoRA, Keras saves each adapted kernel merged (`kernel + a @ b * scale`): keras-hub's
    `from_preset` reads the merged kernels into a model without LoRA."""
    keras.utils.set_random_seed(0)
    keras_hub.models.GemmaBackbone(**TINY_GEMMA).save_to_preset(str(tmp_path / "start"))
    distribution(_mesh_distribution((2, 4)))
    backbone = keras_orbax.from_preset(keras_hub.models.GemmaBackbone, tmp_path / "start")
    embeddings = backbone.token_embedding.embeddings.value
    assert not embeddings.sharding.is_fully_replicated  # loaded sharded
    if lora:
        backbone.enable_lora(2)
    backbone.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    x = _tokens()
    before = [np.asarray(w.value) for w in backbone.weights]
    backbone.fit(x, np.ones((8, 8, TINY_GEMMA["hidden_dim"]), "float32"), epochs=1, verbose=0)
    changed = [
        not np.array_equal(np.asarray(w.value), b)
        for w, b in zip(backbone.weights, before, strict=True)
    ]
    assert any(changed)

    written = keras_orbax.save_to_preset(backbone, tmp_path / "ours", window_bytes=256)
    assert written == tmp_path / "ours"
    backbone.save_to_preset(str(tmp_path / "theirs"))  # keras-hub's own, for the files
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs")

    distribution(None)
    reloaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "ours"))
    if lora:  # the adapters trained, the base kernels frozen: what was saved is the merged kernel
        query = backbone.transformer_layers[0].attention.query_dense
        merged = np.asarray(query.kernel)
        assert not np.array_equal(merged, np.asarray(query._kernel.value))
        loaded = reloaded.transformer_layers[0].attention.query_dense.kernel
        assert np.array_equal(np.asarray(loaded), merged)
        return
    assert len(reloaded.weights) == len(backbone.weights)
    for trained, loaded in zip(backbone.weights, reloaded.weights, strict=True):
        assert np.array_equal(np.asarray(trained.value), np.asarray(loaded.value)), trained.path

    # A byte changed in a dataset: keras-orbax's `from_preset` names the file and the dataset
    entries = json.loads((tmp_path / "ours" / SIDECAR).read_text())["tensors"]
    name, entry = max(entries.items(), key=lambda item: item[1]["bytes"])
    assert name.startswith("model.weights.h5/") and entry["file"] == "model.weights.h5"
    flip_byte(tmp_path / "ours" / entry["file"], entry["offset"] + entry["bytes"] // 2)
    where = rf"model\.weights\.h5: {name}: checksum .*, recorded "
    with pytest.raises(CorruptCheckpointError, match=where):
        keras_orbax.from_preset(keras_hub.models.GemmaBackbone, tmp_path / "ours")


def test_task_preset_as_keras_hub_writes_it(tmp_path, distribution):
    """A task (no preprocessor): `task.json` beside the backbone's files; keras-hub's
    `CausalLM.from_preset` reads it back."""
    distribution(_mesh_distribution((4, 2)))
    keras.utils.set_random_seed(1)
    task = keras_hub.models.GemmaCausalLM(
        backbone=keras_hub.models.GemmaBackbone(**TINY_GEMMA), preprocessor=None
    )
    keras_orbax.save_to_preset(task, tmp_path / "ours")
    task.save_to_preset(str(tmp_path / "theirs"))
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs")
    assert (tmp_path / "ours" / "task.json").is_file()
    distribution(None)
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "ours"))
    assert isinstance(loaded, keras_hub.models.GemmaCausalLM)
    for saved, read in zip(task.backbone.weights, loaded.backbone.weights, strict=True):
        assert np.array_equal(np.asarray(saved.value), np.asarray(read.value)), saved.path


def test_refuses_a_model_that_is_not_keras_hub(tmp_path):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(
        ValueError, match=r"keras-hub Backbone or Task.*`keras_orbax\.save_weights`"
    ):
        keras_orbax.save_to_preset(model, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_convert_a_preset_to_a_preset(tmp_path, distribution):
    """`convert SRC DIR --preset`: keras-hub's `Backbone.from_preset` model of SRC, restored
    sharded, written as the preset keras-hub writes for it."""
    from keras_orbax import cli

    keras.utils.set_random_seed(2)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    backbone.save_to_preset(str(tmp_path / "theirs"))
    distribution(_mesh_distribution((2, 4)))
    source, out = str(tmp_path / "theirs"), str(tmp_path / "ours")
    assert cli.main(["convert", source, out, "--preset", "--quiet"]) == 0
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs", same_model=False)


def test_round_trip_from_two_processes(tmp_path):
    """2 processes x 4 devices: loaded sharded, trained one step, written by both processes into
    one preset, which keras-hub's `from_preset` reads back with exactly the trained values."""
    from tests import _harness

    keras.utils.set_random_seed(3)
    keras_hub.models.GemmaBackbone(**TINY_GEMMA).save_to_preset(str(tmp_path / "start"))
    args = {
        "start": str(tmp_path / "start"),
        "out": str(tmp_path / "ours"),
        "values": str(tmp_path / "trained.npz"),
    }
    results = _harness.run_workers(
        _harness.WORKERS_DIR / "export_preset.py", 2, 4, args, timeout=300
    )
    assert [r["spans_processes"] for r in results] == [True, True]
    trained = np.load(tmp_path / "trained.npz")
    start = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "start"))
    reloaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "ours"))
    assert len(trained.files) == len(reloaded.weights)
    changed = 0
    for before, loaded in zip(start.weights, reloaded.weights, strict=True):
        assert np.array_equal(np.asarray(loaded.value), trained[loaded.path]), loaded.path
        changed += not np.array_equal(np.asarray(before.value), trained[loaded.path])
    assert changed > 0  # the step trained something
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == [
        "config.json",
        SIDECAR,
        "metadata.json",
        "model.weights.h5",
    ]
    verified = keras_orbax.verify(tmp_path / "ours")  # both processes' regions, read back
    with h5py.File(tmp_path / "ours" / "model.weights.h5") as h5:
        datasets = _dataset_names(h5)
    assert verified.intact and verified.checksummed == len(datasets), verified


def test_convert_a_hugging_face_directory_to_a_preset(tmp_path, distribution):
    """`convert HF_DIR DIR --preset`: the keras-hub model of a Hugging Face directory, as the
    preset keras-hub writes for the model its own `from_preset` reads from that directory."""
    from tests import _hf_export

    keras.utils.set_random_seed(4)
    gemma = keras_hub.models.GemmaBackbone(**_hf_export.GEMMA)  # bfloat16
    gemma.export_to_transformers(str(tmp_path / "hf"))
    theirs = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "hf"))
    theirs.save_to_preset(str(tmp_path / "theirs"))
    distribution(_hf_export.model_parallel("gemma"))
    keras_orbax.convert(tmp_path / "hf", tmp_path / "ours", preset=True)
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs", same_model=False)
    distribution(None)
    reloaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "ours"))
    for original, loaded in zip(gemma.weights, reloaded.weights, strict=True):
        assert np.array_equal(np.asarray(original.value), np.asarray(loaded.value)), original.path


def test_a_task_with_its_preprocessor(tmp_path, distribution):
    """A Llama3 CausalLM with its preprocessor and tokenizer: keras-hub's own writers give the
    preprocessor, tokenizer and assets files, equal to its `save_to_preset`'s."""
    from tests import _hf_export

    distribution(_hf_export.model_parallel("llama3"))
    keras.utils.set_random_seed(5)
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        tokenizer=_hf_export.llama3_tokenizer(), sequence_length=8
    )
    backbone = keras_hub.models.Llama3Backbone(**_hf_export.LLAMA3)
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=preprocessor)
    keras_orbax.save_to_preset(task, tmp_path / "ours")
    task.save_to_preset(str(tmp_path / "theirs"))
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs")
    assets = sorted(p.relative_to(tmp_path / "theirs") for p in (tmp_path / "theirs").rglob("*"))
    assert sorted([*assets, Path(SIDECAR)]) == sorted(
        p.relative_to(tmp_path / "ours") for p in (tmp_path / "ours").rglob("*")
    )
    assert any(p.parts[0] == "assets" for p in assets)
    for name in assets:
        if (tmp_path / "theirs" / name).is_file() and name.parts[0] == "assets":
            assert (tmp_path / "ours" / name).read_bytes() == (
                tmp_path / "theirs" / name
            ).read_bytes()
    # `convert PRESET DIR --preset` of a task preset writes the task (its task.json, preprocessor
    # and tokenizer assets), not only its backbone.
    keras_orbax.convert(tmp_path / "theirs", tmp_path / "converted", preset=True)
    _same_preset_files(tmp_path / "converted", tmp_path / "theirs", same_model=False)
    assert sorted([*assets, Path(SIDECAR)]) == sorted(
        p.relative_to(tmp_path / "converted") for p in (tmp_path / "converted").rglob("*")
    )
    distribution(None)
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "ours"))
    assert loaded.preprocessor.tokenizer.vocabulary == preprocessor.tokenizer.vocabulary


def test_a_backbone_above_max_shard_size_is_sharded_as_keras_hub_shards_it(tmp_path, distribution):
    distribution(_mesh_distribution((2, 4)))
    keras.utils.set_random_seed(6)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    shard_gb = 4096 / 1024**3
    keras_orbax.save_to_preset(backbone, tmp_path / "ours", max_shard_size=shard_gb)
    backbone.save_to_preset(str(tmp_path / "theirs"), max_shard_size=shard_gb)
    _same_preset_files(tmp_path / "ours", tmp_path / "theirs")
    names = [p.name for p in (tmp_path / "ours").iterdir()]
    assert "model.weights.json" in names and "model.weights.h5" not in names
    assert sum(n.startswith("model_") for n in names) > 2
    distribution(None)
    reloaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "ours"))
    for saved, loaded in zip(backbone.weights, reloaded.weights, strict=True):
        assert np.array_equal(np.asarray(saved.value), np.asarray(loaded.value)), saved.path


def test_saving_again_in_the_other_form_leaves_one_weights_form(tmp_path, distribution):
    """keras-hub reads `model.weights.h5` where there is one: a preset saved again sharded (or
    whole after sharded) keeps only the form just written, so keras-hub and keras-orbax both load
    the new weights, and keras-orbax reads what keras-hub reads where a preset holds both."""
    distribution(_mesh_distribution((2, 4)))
    keras.utils.set_random_seed(7)
    old, new = (keras_hub.models.GemmaBackbone(**TINY_GEMMA) for _ in range(2))
    shard_gb = 4096 / 1024**3
    for first, second in ((None, shard_gb), (shard_gb, None)):
        directory = tmp_path / f"first_{first}"
        keras_orbax.save_to_preset(old, directory, max_shard_size=first)
        keras_orbax.save_to_preset(new, directory, max_shard_size=second)
        names = sorted(p.name for p in directory.iterdir())
        assert ("model.weights.h5" in names) == (second is None), names
        assert ("model.weights.json" in names) == (second is not None), names
        if second is None:
            assert not any(n.startswith("model_") for n in names), names
        distribution(None)
        for loaded in (
            keras_hub.models.GemmaBackbone.from_preset(str(directory)),
            keras_orbax.from_preset(keras_hub.models.GemmaBackbone, directory),
        ):
            for saved, got in zip(new.weights, loaded.weights, strict=True):
                assert np.array_equal(np.asarray(saved.value), np.asarray(got.value)), saved.path
        distribution(_mesh_distribution((2, 4)))
    # Both forms in one preset (keras-hub's own saves leave the other): the .h5, as keras-hub.
    both = tmp_path / "both"
    old.save_to_preset(str(both))
    new.save_to_preset(str(both), max_shard_size=shard_gb)
    distribution(None)
    theirs = keras_hub.models.GemmaBackbone.from_preset(str(both))
    ours = keras_orbax.from_preset(keras_hub.models.GemmaBackbone, both)
    for a, b in zip(theirs.weights, ours.weights, strict=True):
        assert np.array_equal(np.asarray(a.value), np.asarray(b.value)), a.path


def test_a_task_heads_weights_are_checked_too(tmp_path, distribution):
    """A classifier's head (`task.weights.h5`, which keras-hub's own loader reads after the
    backbone): its datasets are in the preset's sidecar, and `verify` and `from_preset` check
    them with the backbone's."""
    distribution(_mesh_distribution((4, 2)))
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=16,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    )
    task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
    keras_orbax.save_to_preset(task, tmp_path / "p")
    assert keras_orbax.verify(tmp_path / "p").intact
    entries = json.loads((tmp_path / "p" / SIDECAR).read_text())["tensors"]
    head = {n: e for n, e in entries.items() if e["file"] == "task.weights.h5"}
    name, entry = max(head.items(), key=lambda item: item[1]["bytes"])
    flip_byte(tmp_path / "p" / "task.weights.h5", entry["offset"] + entry["bytes"] // 2)
    where = rf"task\.weights\.h5: {re.escape(name)}: checksum .*, recorded "
    with pytest.raises(CorruptCheckpointError, match=where):
        keras_orbax.verify(tmp_path / "p")
    with pytest.raises(CorruptCheckpointError, match=where):
        keras_orbax.from_preset(keras_hub.models.BertTextClassifier, tmp_path / "p")
