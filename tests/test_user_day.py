"""A new user's day (issue 37): each thing that went wrong when keras-orbax was tried from the
README and the docs, as a test of what a user now gets."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax import cli
from keras_orbax._src.tools.plan_report import plan_restore_report
from keras_orbax.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KerasOrbaxWarning,
    SaveFailedError,
    UnsupportedSourceError,
)
from tests import _models, cli_models
from tests._hub import import_keras_hub

keras_hub = import_keras_hub()

STEPS = (4, 8, 12)


@pytest.fixture(name="ckpt")
def _ckpt(tmp_path):
    model = cli_models.mlp()
    for step in STEPS:
        keras_orbax.save(model, tmp_path / "ckpt", step=step)
    return tmp_path / "ckpt"


VERBS = {
    "save": lambda m, d, step: keras_orbax.save(m, d, step=step),
    "restore_sharded": lambda m, d, step: keras_orbax.restore_sharded(m, d, step=step),
    "load_model": lambda m, d, step: keras_orbax.load_model(d, step=step),
    "inspect": lambda m, d, step: keras_orbax.inspect(d, step=step),
    "verify": lambda m, d, step: keras_orbax.verify(d, step=step),
    "plan": lambda m, d, step: plan_restore_report(m, d, step),
}


@pytest.mark.parametrize("verb", VERBS)
def test_a_step_given_as_a_string_gets_one_type_error_in_every_verb(ckpt, verb):
    """`step="8"` (read from argv) had every reading verb say "Step 8 is not a committed step
    ... Committed steps: [4, 8, 12]"; `save` a TypeError. Now each says the same."""
    with pytest.raises(TypeError) as raised:
        VERBS[verb](cli_models.mlp(), ckpt, "8")
    assert str(raised.value) == (
        "step must be an integer (it names the step's directory), not a string: pass "
        "step=int('8'). Received: step='8'"
    )


@pytest.mark.parametrize("step", [8.0, True], ids=["float", "bool"])
@pytest.mark.parametrize("verb", ["restore_sharded", "inspect"])
def test_a_step_that_is_no_integer_is_refused_as_save_refuses_it(ckpt, verb, step):
    with pytest.raises(TypeError, match=r"step must be an integer .*Received: step=(8\.0|True)$"):
        VERBS[verb](cli_models.mlp(), ckpt, step)


@pytest.mark.parametrize(
    "step",
    [np.int64(8), np.array(8), keras.Variable(8, dtype="int32")],
    ids=["numpy", "0-d array", "variable"],
)
def test_an_integer_step_of_any_kind_names_the_step(ckpt, step):
    model = cli_models.mlp()
    assert keras_orbax.restore_sharded(model, ckpt, step=step).step == 8
    assert keras_orbax.inspect(ckpt, step=step).step == 8


def _unique_bytes(root) -> int:
    """What `du` counts for the steps under `root`: each file once, hard links included."""
    stats = [p.stat() for p in root.glob("[0-9]*/**/*") if p.is_file()]
    return sum({(s.st_dev, s.st_ino): s.st_size for s in stats}.values())


def test_inspect_shows_what_an_incremental_step_alone_holds(tmp_path):
    """`inspect` showed each incremental step at its full size where `du` showed far less: it now
    shows what each step alone holds, which is what deleting it frees, and the total `du` shows."""
    model = _models.mlp(width=256)  # a kernel large enough to dwarf the metadata files
    ckpt = tmp_path / "ckpt"
    keras_orbax.save(model, ckpt, step=1)
    model.layers[-1].kernel.assign(np.ones(model.layers[-1].kernel.shape))  # the head changes
    keras_orbax.save(model, ckpt, step=2)
    info = keras_orbax.inspect(ckpt)
    first, second = info.summaries
    assert info.disk_bytes == _unique_bytes(ckpt)
    assert second.own_bytes < second.disk_bytes / 2  # the hidden kernel is linked, not held
    assert second.own_bytes > 256 * 8 * 4 / 2  # the changed head's shard is held
    before = _unique_bytes(ckpt)
    shutil.rmtree(ckpt / "1")
    assert before - _unique_bytes(ckpt) == first.own_bytes
    printed = str(info)
    assert re.search(r"on disk +its own +metrics\n +1 ", printed)
    assert "on disk for all steps; 'its own' is what no other step shares" in printed
    assert keras_orbax.inspect(ckpt).summaries[0].own_bytes == second.disk_bytes


@pytest.mark.parametrize("spelling", ["ckpt/9", "ckpt/9/", "ckpt@9"])
def test_a_step_not_committed_lists_the_committed_ones_however_it_is_spelled(
    ckpt, monkeypatch, spelling
):
    monkeypatch.chdir(ckpt.parent)
    with pytest.raises(CheckpointNotFoundError) as raised:
        keras_orbax.inspect(spelling)
    assert str(raised.value).startswith(
        f"Step 9 is not a committed step of '{ckpt}'. Committed steps: [4, 8, 12]."
    )
    assert cli.main(["inspect", spelling]) == 2


def test_a_folder_of_keras_files_is_not_called_a_preset(tmp_path):
    model = cli_models.mlp()
    model.save_weights(tmp_path / "model.weights.h5")
    model.save(tmp_path / "model.keras")
    with pytest.raises(CheckpointNotFoundError) as raised:
        keras_orbax.inspect(tmp_path)
    assert str(raised.value) == (
        f"'{tmp_path}' holds Keras files (model.keras, model.weights.h5) but no config.json: it "
        "is not a keras-hub preset (keras-hub builds the model from its config.json) nor a "
        f"checkpoint directory. Pass one of the files, e.g. '{tmp_path / 'model.keras'}'."
    )


def test_a_keras_archive_is_called_an_archive(tmp_path, capsys):
    cli_models.mlp().save(tmp_path / "m.keras")
    assert cli.main(["inspect", str(tmp_path / "m.keras")]) == 0
    assert "written by Keras (a .keras archive)" in capsys.readouterr().out
    with pytest.raises(UnsupportedSourceError, match=r"m\.keras' \(Keras \.keras archive\)"):
        keras_orbax.from_preset(keras_hub.models.GemmaBackbone, tmp_path / "m.keras")


def test_a_mistyped_preset_name_is_no_missing_checkpoint_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as raised:
        keras_orbax.from_preset(keras_hub.models.GemmaBackbone, "gemma_2b_ne")
    assert str(raised.value) == (
        f"No such preset: 'gemma_2b_ne' is neither a directory ('{tmp_path / 'gemma_2b_ne'}' does "
        "not exist) nor one of keras-hub's preset names for GemmaBackbone. Did you mean "
        "'gemma_2b_en' or 'gemma2_2b_en' or 'gemma2_27b_en'? Received: preset='gemma_2b_ne'"
    )
    with pytest.raises(CheckpointNotFoundError, match=r"GemmaBackbone\.presets lists the \d+"):
        keras_orbax.from_preset(keras_hub.models.GemmaBackbone, "gemma_tyop")


def test_a_failed_save_message_ends_without_a_trailing_space(tmp_path):
    (tmp_path / "afile.txt").write_text("not a directory")
    with pytest.raises(SaveFailedError) as raised:
        keras_orbax.save(cli_models.mlp(), tmp_path / "afile.txt", step=1)
    message = str(raised.value)  # what the directory holds, listed after the failure
    assert message.endswith("Nothing was committed. No step is committed in the directory.")


def test_convert_keeps_the_source_steps_step_epoch_and_metrics(tmp_path, capsys):
    """`convert ckpt@8 DST` wrote step 0 with the source's epoch and no metrics: the converted
    step is now the source's, unless a step is given."""
    model = _models.compile_adam(_models.mlp())
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16)), rng.random((32, 8))  # 4 batches of 8 per epoch
    callback = keras_orbax.ModelCheckpoint(tmp_path / "ckpt", max_to_keep=None)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], verbose=0)
    source = keras_orbax.inspect(tmp_path / "ckpt", step=4)
    assert cli.main(["convert", f"{tmp_path / 'ckpt'}@4", str(tmp_path / "dst"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    converted = keras_orbax.inspect(tmp_path / "dst")
    assert converted.steps == (4,) and converted.record.epoch == source.record.epoch == 1
    assert converted.summaries[0].metrics == source.summaries[0].metrics
    assert set(converted.summaries[0].metrics) == {"loss", "mae"}
    keras_orbax.convert(tmp_path / "ckpt", tmp_path / "dst", step=20)  # told otherwise
    assert keras_orbax.inspect(tmp_path / "dst").steps == (4, 20)
    keras_orbax.convert(tmp_path / "ckpt" / "8", tmp_path / "other")
    assert keras_orbax.inspect(tmp_path / "other").record.epoch == 2


@pytest.mark.filterwarnings("default::keras_orbax.errors.KerasOrbaxWarning")  # the CLI's output
def test_convert_on_the_command_line_can_set_a_distribution(tmp_path, capsys):
    """The warning that no distribution is set named a Python call; the command line now takes
    `--mesh` and `--layout-map`, and the warning names them."""
    model = cli_models.mlp()
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    destination = str(tmp_path / "x.weights.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KerasOrbaxWarning)
        code = cli.main(["convert", str(tmp_path / "ckpt"), destination, "--mesh", "8"])
    assert code == 0
    _, err = capsys.readouterr()
    assert "warning" not in err
    layout_map = "tests.cli_models:layout_map"
    args = ["convert", str(tmp_path / "ckpt"), destination, "--mesh", "2x4"]
    assert cli.main([*args, "--layout-map", layout_map]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (
        cli.main(["convert", str(tmp_path / "ckpt"), destination, "--layout-map", layout_map]) == 2
    )
    assert (
        "error: --layout-map needs --mesh, whose device mesh it is given" in capsys.readouterr().err
    )
    assert cli.main(["convert", str(tmp_path / "ckpt"), destination]) == 0
    err = capsys.readouterr().err
    assert "No keras.distribution is set" in err
    assert "Pass --mesh (e.g. --mesh 1x8) with --layout-map MODULE:FUNCTION" in err
    restored = cli_models.mlp()
    restored.load_weights(destination)  # Keras's own loader
    for got, want in zip(restored.weights, model.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


GEMMA = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=16,
    intermediate_dim=32,
    head_dim=8,
)


def test_a_preset_converted_to_a_checkpoint_converts_back_to_a_preset(tmp_path):
    """preset -> checkpoint -> preset: the step keeps keras-hub's config, so the second convert
    knows the model; keras-hub's own `from_preset` reads the result as it reads the original."""
    backbone = keras_hub.models.GemmaBackbone(**GEMMA)
    backbone.save_to_preset(tmp_path / "preset")
    for args in (["preset", "ckpt"], ["ckpt", "again", "--preset"]):
        assert cli.main(["convert", *(str(tmp_path / a) for a in args[:2]), *args[2:]]) == 0
    original = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "preset"))
    again = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "again"))
    assert again.get_config() == original.get_config()
    for got, want in zip(again.weights, original.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert isinstance(keras_orbax.load_model(tmp_path / "ckpt"), keras_hub.models.GemmaBackbone)


def _no_codecs(spec: dict) -> dict:
    return {**spec, "codecs": []}


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p: p.write_text(p.read_text()[:40]), "is damaged: not valid JSON"),
        (lambda p: p.write_text("[1, 2]"), "is damaged: not a JSON object"),
        (lambda p: p.unlink(), "is missing"),
        (lambda p: p.write_text(json.dumps(_no_codecs(json.loads(p.read_text())))), "codec"),
    ],
    ids=["truncated", "not-an-object", "deleted", "no-codecs"],
)
def test_a_damaged_zarr_json_is_one_clear_error_naming_the_file(
    tmp_path, capfd, caplog, damage, says
):
    """A damaged `zarr.json` gave Orbax's `WARNING:root:` line, then an error carrying about
    1,000 characters of tensorstore spec."""
    model = cli_models.mlp()
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    spec = tmp_path / "ckpt" / "1" / "state" / "layers.dense.vars.0" / "zarr.json"
    damage(spec)
    capfd.readouterr()
    with pytest.raises(CorruptCheckpointError) as raised:
        keras_orbax.restore_sharded(cli_models.mlp(), tmp_path / "ckpt")
    message = str(raised.value)
    assert str(spec) in message and says in message and "layers/dense/vars/0" in message
    assert "tensorstore_spec" not in message and len(message.replace(str(tmp_path), "")) < 400
    assert "TensorStore data files not found" not in capfd.readouterr().err + caplog.text


def test_a_restore_result_names_variables_by_their_keras_paths(tmp_path):
    """`RestoreResult` listed `optimizer/vars/0` where Keras paths are wanted."""
    trained = _models.compile_adam(_models.mlp())
    rng = np.random.default_rng(0)
    trained.fit(rng.random((8, 16)), rng.random((8, 8)), verbose=0)
    keras_orbax.save(trained, tmp_path / "ckpt", step=1)
    model = _models.mlp()  # not compiled: the optimizer's and the metrics' state is skipped
    with pytest.warns(KerasOrbaxWarning, match="has no optimizer"):
        result = keras_orbax.restore_sharded(model, tmp_path / "ckpt", strict=False)
    assert result.restored_paths == tuple(v.path for v in model.weights)
    saved = [v.path for v in trained.optimizer.variables + trained.metrics_variables]
    assert sorted(result.skipped_paths) == sorted(saved)
    assert result.initialized_paths == ()
    shown = repr(result)
    assert f"skipped=[{saved[0]}, " in shown and "optimizer/vars" not in shown


def test_the_demo_says_which_mesh_it_restores_onto(tmp_path):
    """Run as documented (no `--directory`): its checkpoint goes to a temporary directory, which
    it removes when it is done."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    env = {**os.environ, "PYTHONPATH": str(demo.parents[1]), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(demo)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training on mesh (2, 4) ('batch', 'model') (8 devices)" in done.stdout
    restoring = "restoring onto mesh (4, 2) ('batch', 'model') (8 devices; trained on mesh (2, 4))"
    assert restoring in done.stdout
    assert "predictions match the trained model's" in done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("keras-orbax-demo-")]


@pytest.mark.parametrize(
    ("layout", "breaks"),
    [
        (dict(num_key_value_heads=2, hidden_dim=32), "load"),  # k/v: the first head only
        (dict(num_key_value_heads=1, hidden_dim=16), "query"),  # q_proj reshaped, not transposed
        (dict(num_key_value_heads=1, hidden_dim=32), None),  # Gemma 2B's layout
    ],
    ids=["two-kv-heads", "hidden-not-heads-x-head-dim", "gemma-2b-layout"],
)
def test_what_keras_hub_reads_back_of_a_gemma_hugging_face_export(tmp_path, layout, breaks):
    """docs/exporting.md says which Gemma exports keras-hub 0.32 reads back: its own exporter's
    limits, which keras-orbax's export corrects (keras-hub's loader reads every variable back). A
    keras-hub that fixes them fails this test, and the page is to be updated."""
    config = {**GEMMA, "num_query_heads": 4, "head_dim": 8, **layout}
    backbone = keras_hub.models.GemmaBackbone(**config)
    backbone.export_to_transformers(str(tmp_path / "hub"))
    keras_orbax.export_to_transformers(backbone, tmp_path / "ours")
    same = (tmp_path / "hub" / "model.safetensors").read_bytes() == (
        tmp_path / "ours" / "model.safetensors"
    ).read_bytes()
    assert same is (breaks is None)
    ours = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "ours"))
    for a, b in zip(backbone.weights, ours.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    if breaks == "load":
        with pytest.raises(ValueError, match="cannot reshape array"):
            keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "hub"))
        return
    reloaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path / "hub"))
    differ = [
        a.path
        for a, b in zip(backbone.weights, reloaded.weights, strict=True)
        if not np.array_equal(a.numpy(), b.numpy())
    ]
    assert differ == ([] if breaks is None else ["decoder_block_0/attention/query/kernel",
                                                  "decoder_block_1/attention/query/kernel"])  # fmt: skip
    with pytest.raises(KeyError, match="architectures"):
        keras_hub.models.CausalLM.from_preset(str(tmp_path / "hub"))
