"""Every verb, in Python and on the command line, on every kind of source, however it is spelled.

One trained MLP is saved by keras-orbax, by Keras's `OrbaxCheckpoint`, as a `.weights.h5` and as a
`.keras`; one tiny keras-hub Llama3 backbone as a preset and as a Hugging Face directory. Each verb
gets each location as a relative path, an absolute path, a `~` path, with a trailing slash and
through a symbolic link (and a step as `DIR/STEP`, `DIR@STEP` and `DIR@STEP/`): every spelling
must give the same answer, the answer must be the source's own (values equal to the model that was
saved, shardings those of the active distribution), and a verb that cannot serve a kind must say
which verb can, in one line.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax import cli
from keras_orbax._src.tools.convert import convert
from keras_orbax._src.tools.diff import diff
from keras_orbax._src.tools.plan_report import plan_restore_report
from keras_orbax.errors import CheckpointNotFoundError, KerasOrbaxWarning, UnsupportedSourceError
from tests import cli_models
from tests._hub import import_keras_hub

keras_hub = import_keras_hub()

STEP = 3
LLAMA = dict(
    vocabulary_size=64,
    num_layers=1,
    num_query_heads=4,
    num_key_value_heads=4,  # divisible by the mesh's batch axis, which its layout map uses
    hidden_dim=16,
    intermediate_dim=32,
)


def build_llama() -> keras.Model:
    """The preset's architecture (keras-hub 0.32's Llama3 config does not keep
    `tie_word_embeddings`: its own `from_preset` fails on a tied model's preset)."""
    return keras_hub.models.Llama3Backbone(**LLAMA, tie_word_embeddings=False)


def build_tied_llama() -> keras.Model:
    """The Hugging Face directory's architecture (keras-hub's export leaves out an untied
    `lm_head`, which its own loader then asks for)."""
    return keras_hub.models.Llama3Backbone(**LLAMA, tie_word_embeddings=True)


# kind, name in the fixture's directory, the architecture, whether it has steps
KINDS = {
    "keras-orbax": ("orbax_ckpt", "mlp", True),
    "keras-checkpoint": ("keras_ckpt", "mlp", True),
    "keras-weights": ("mlp.weights.h5", "mlp", False),
    "keras-archive": ("mlp.keras", "mlp", False),
    "keras-preset": ("preset", "llama", False),
    "transformers": ("hf", "tied_llama", False),
}
BUILD = {"mlp": cli_models.mlp, "llama": build_llama, "tied_llama": build_tied_llama}
MODEL_SPEC = {
    "mlp": "tests.cli_models:mlp",
    "llama": "tests.test_every_verb:build_llama",
    "tied_llama": "tests.test_every_verb:build_tied_llama",
}
SOURCE_KIND = {"keras-archive": "keras-weights"}  # what `inspect` calls it
# What each verb that cannot serve a kind names instead.
LOAD_MODEL_USE = {
    "keras-weights": "restore_sharded",
    "keras-preset": "from_preset",
    "transformers": "from_preset",
}
FROM_PRESET_USE = {
    "keras-orbax": "load_model",
    "keras-checkpoint": "load_model",
    "keras-weights": "restore_sharded",
    "keras-archive": "load_model",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: absolute path} and {architecture: {variable path: value}} of what was saved."""
    root = tmp_path_factory.mktemp("home")
    mlp = cli_models.mlp()
    mlp.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 16), "float32"), rng.standard_normal((8, 8), "float32")
    callback = keras.callbacks.OrbaxCheckpoint(
        str(root / "keras_ckpt"), save_freq=1, save_on_background=False
    )
    mlp.fit(x, y, epochs=1, steps_per_epoch=STEP, batch_size=2, verbose=0, callbacks=[callback])
    keras_orbax.save(mlp, root / "orbax_ckpt", step=STEP)
    mlp.save_weights(root / "mlp.weights.h5")
    mlp.save(root / "mlp.keras")
    references = {"mlp": {v.path: np.asarray(v.value) for v in mlp.weights}}
    for architecture, save in (
        ("llama", lambda model: model.save_to_preset(str(root / "preset"))),
        ("tied_llama", lambda model: model.export_to_transformers(str(root / "hf"))),
    ):
        llama = BUILD[architecture]()
        for i, variable in enumerate(llama.weights):
            variable.assign(np.random.default_rng(i).standard_normal(variable.shape) * 0.1)
        save(llama)
        references[architecture] = {v.path: np.asarray(v.value) for v in llama.weights}
    for name, _, _ in KINDS.values():
        (root / f"link-{name}").symlink_to(name)
    return root, references


@pytest.fixture
def home(saved, monkeypatch):
    """The fixture's directory is the working directory and `~`."""
    root, _ = saved
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(root))
    return root


def spellings(root: Path, kind: str) -> dict[str, str]:
    name, _, has_steps = KINDS[kind]
    absolute = str(root / name)
    found = {"absolute": absolute, "relative": name, "home": f"~/{name}", "slash": f"{absolute}/"}
    found["symlink"] = f"link-{name}"  # a relative symbolic link to it
    if has_steps:
        found |= {
            "step directory": f"{name}/{STEP}",
            "at step": f"~/{name}@{STEP}",
            "at step, slash": f"{name}@{STEP}/",
        }
    return found


def _same_for_every_spelling(root: Path, kind: str, answer) -> object:
    """`answer(location)` for every spelling; they must all be equal. Returns that answer."""
    answers = {how: answer(location) for how, location in spellings(root, kind).items()}
    first = answers["absolute"]
    different = {how: a for how, a in answers.items() if a != first}
    assert not different, f"absolute gives {first!r}, but {different!r}"
    return first


def _assert_values(model: keras.Model, reference: dict[str, np.ndarray]) -> None:
    for variable in model.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), reference[variable.path], err_msg=variable.path
        )


def _distribute(distribution, architecture: str) -> None:
    """ModelParallel on a (4, 2) mesh with the architecture's own layout map."""
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), jax.devices())
    if architecture != "mlp":
        layout_map = keras_hub.models.Llama3Backbone.get_layout_map(mesh)
    else:
        layout_map = cli_models.layout_map(mesh)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))


def _shardings(model: keras.Model) -> dict[str, str]:
    return {v.path: repr(v.value.sharding) for v in model.weights}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


KIND_NAMES = list(KINDS)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_restore_sharded(home, saved, kind, distribution):
    _, references = saved
    architecture = KINDS[kind][1]
    _distribute(distribution, architecture)
    expected = _shardings(BUILD[architecture]())  # what Keras places under this distribution

    def restored(location: str) -> dict[str, str]:
        with keras_orbax.deferred_init():
            model = BUILD[architecture]()
        keras_orbax.restore_sharded(model, location)
        _assert_values(model, references[architecture])
        return _shardings(model)

    assert _same_for_every_spelling(home, kind, restored) == expected


def _loaded_or_why(load, reference: dict[str, np.ndarray]) -> object:
    """The shardings of the model `load()` makes, its values checked against `reference`; or, for
    a verb that cannot serve the source, what its one-line error says to do instead (the part
    after the location, which differs by spelling)."""
    try:
        model = load()
    except UnsupportedSourceError as error:
        assert len(str(error).splitlines()) == 1
        return str(error).split(": ", 1)[1]
    _assert_values(model, reference)
    return _shardings(model)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_load_model(home, saved, kind, distribution):
    _, references = saved
    architecture = KINDS[kind][1]
    _distribute(distribution, architecture)
    expected = _shardings(BUILD[architecture]())

    def loaded(location: str) -> object:
        return _loaded_or_why(lambda: keras_orbax.load_model(location), references[architecture])

    answer = _same_for_every_spelling(home, kind, loaded)
    if kind in LOAD_MODEL_USE:
        assert LOAD_MODEL_USE[kind] in answer
    else:
        assert answer == expected


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_from_preset(home, saved, kind, distribution):
    _, references = saved
    architecture = "tied_llama" if kind == "transformers" else "llama"
    _distribute(distribution, architecture)
    expected = _shardings(BUILD[architecture]())

    def loaded(location: str) -> object:
        return _loaded_or_why(
            lambda: keras_orbax.from_preset(keras_hub.models.Llama3Backbone, location),
            references[architecture],
        )

    answer = _same_for_every_spelling(home, kind, loaded)
    if kind in FROM_PRESET_USE:
        assert FROM_PRESET_USE[kind] in answer
    else:
        assert answer == expected


def _listing(kind: str, info) -> list[tuple]:
    assert info.kind == SOURCE_KIND.get(kind, kind)
    return sorted((v.key, v.path, v.shape, v.dtype) for v in info.record.variables.values())


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_inspect(home, saved, kind, capsys):
    _, references = saved
    architecture = KINDS[kind][1]
    listing = _same_for_every_spelling(
        home, kind, lambda location: _listing(kind, keras_orbax.inspect(location))
    )
    shapes = {path: value.shape for path, value in references[architecture].items()}
    if kind in ("keras-orbax", "keras-checkpoint"):  # they record Keras paths
        weights = [(path, shape) for _, path, shape, _ in listing if path in shapes]
        assert sorted(weights) == sorted(shapes.items())
    elif kind != "transformers":  # h5 datasets: the weights, by structure (paths unknown)
        layers = [shape for key, _, shape, _ in listing if key.startswith("layers/")]
        assert sorted(layers) == sorted(shapes.values())

    def shown(location: str) -> list[tuple]:
        code, out, err = _cli(capsys, "inspect", location, "--json")
        assert code == 0, err
        document = json.loads(out)
        assert document["kind"] == SOURCE_KIND.get(kind, kind)
        return sorted(
            (v["key"], v["path"], tuple(v["shape"]), v["dtype"]) for v in document["variables"]
        )

    assert _same_for_every_spelling(home, kind, shown) == listing


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_verify(home, saved, kind, capsys):
    keys = sorted(keras_orbax.inspect(home / KINDS[kind][0]).record.variables)

    def checked(location: str) -> tuple:
        result = keras_orbax.verify(location)
        return result.intact, result.checksummed > 0, sorted(result.unchecked)

    intact, checksummed, unchecked = _same_for_every_spelling(home, kind, checked)
    if kind == "keras-orbax":  # the only kind that records checksums
        assert (intact, checksummed, unchecked) == (True, True, [])
    else:  # read back whole, but nothing to compare with: never called intact
        assert (intact, checksummed, unchecked) == (False, False, keys)

    def shown(location: str) -> tuple:
        code, out, err = _cli(capsys, "verify", location, "--json")
        assert code == (0 if intact else 1), err
        return json.loads(out)["intact"], sorted(json.loads(out)["unchecked"])

    assert _same_for_every_spelling(home, kind, shown) == (intact, unchecked)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_diff(home, saved, kind, capsys):
    absolute = str(home / KINDS[kind][0])

    def compared(location: str) -> tuple:
        result = diff(location, absolute, values=True)
        assert result.compared > 0
        return result.identical, result.compared

    identical, _ = _same_for_every_spelling(home, kind, compared)
    assert identical

    def shown(location: str) -> int:
        code, _, err = _cli(capsys, "diff", location, absolute, "--values")
        assert not err.strip(), err
        return code

    assert _same_for_every_spelling(home, kind, shown) == 0


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_plan(home, saved, kind, capsys, distribution):
    _, references = saved
    architecture = KINDS[kind][1]
    _distribute(distribution, architecture)
    total = sum(value.nbytes for value in references[architecture].values())

    def planned(location: str) -> tuple:
        with keras_orbax.deferred_init():
            model = BUILD[architecture]()
        report = plan_restore_report(model, location)
        return report.problems, report.nbytes, sorted(report.device_bytes.items())

    problems, nbytes, _ = _same_for_every_spelling(home, kind, planned)
    assert problems == []
    assert nbytes >= total  # the weights, and for a step its optimizer state too

    def shown(location: str) -> tuple:
        code, out, err = _cli(
            capsys, "plan", location, "--model", MODEL_SPEC[architecture], "--json"
        )
        assert code == 0, err
        return json.loads(out)["problems"], json.loads(out)["nbytes"]

    assert _same_for_every_spelling(home, kind, shown) == ([], nbytes)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_convert(home, saved, kind, capsys, tmp_path):
    _, references = saved
    architecture = KINDS[kind][1]
    counter = iter(range(100))

    def converted(location: str) -> object:
        destination = tmp_path / f"python{next(counter)}"
        try:
            step_dir = convert(location, destination)
        except UnsupportedSourceError as error:
            assert len(str(error).splitlines()) == 1
            with keras_orbax.deferred_init():
                model = BUILD[architecture]()
            step_dir = convert(location, destination, model=model)  # what the error says
            assert "model" in str(error)
        restored = BUILD[architecture]()
        keras_orbax.restore_sharded(restored, destination)
        _assert_values(restored, references[architecture])
        return Path(step_dir).name

    # A checkpoint step keeps its step; other kinds have none, and are written as step 0.
    assert _same_for_every_spelling(home, kind, converted) == str(STEP if KINDS[kind][2] else 0)

    def shown(location: str) -> int:
        destination = tmp_path / f"cli{next(counter)}"
        code, _, err = _cli(capsys, "convert", location, str(destination))
        if kind == "transformers":
            assert "--model" in err and len(err.strip().splitlines()) == 1
            return code
        restored = BUILD[architecture]()
        keras_orbax.restore_sharded(restored, destination)
        _assert_values(restored, references[architecture])
        return code

    assert _same_for_every_spelling(home, kind, shown) == (2 if kind == "transformers" else 0)


def test_convert_refuses_a_directory_that_holds_another_kind(saved, tmp_path):
    """A preset written into a checkpoint root, or a step into a preset, would hide one behind the
    other (`inspect` and every verb would see only one): refused before anything is read."""
    root, _ = saved
    for name in ("orbax_ckpt", "preset", "hf"):
        shutil.copytree(root / name, tmp_path / name)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    refused = {
        ("preset", "orbax_ckpt", "preset"): "holds checkpoint steps: convert writes a keras-hub",
        ("preset", "hf", "preset"): "holds a Hugging Face model directory",
        ("preset", "orbax_ckpt", "transformers"): "holds checkpoint steps",
        ("mlp.weights.h5", "preset", None): "holds a keras-hub preset: convert writes checkpoint",
        ("mlp.weights.h5", "hf", None): "holds a Hugging Face model directory",
    }
    for (source, destination, writes), says in refused.items():
        flags = {"preset": writes == "preset", "transformers": writes == "transformers"}
        with pytest.raises(ValueError, match=says):
            convert(root / source, tmp_path / destination, **flags)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("removed", "says"),
    [
        ("model.weights.h5", "has a config.json but no weights file"),
        ("config.json", "no config.json"),
    ],
)
def test_half_a_preset_is_named_as_one(saved, tmp_path, removed, says):
    """A preset directory that lost its weights file or its config is said to be one, naming what
    it lacks, by every verb (it had been taken for a checkpoint directory without steps)."""
    root, _ = saved
    damaged = tmp_path / "preset"
    shutil.copytree(root / "preset", damaged)
    (damaged / removed).unlink()
    for verb in (keras_orbax.inspect, keras_orbax.verify):
        with pytest.raises(CheckpointNotFoundError, match=f"Preset directory .*{says}"):
            verb(damaged)
    with pytest.raises(CheckpointNotFoundError, match=says):
        keras_orbax.restore_sharded(build_llama(), damaged)
    # Exported into again (a preset export writes its weights first, so a failed one leaves a
    # weights file without config): a destination of the same kind, not refused.
    keras_orbax.convert(root / "preset", damaged, preset=True)
    assert (damaged / "config.json").is_file() and (damaged / "model.weights.h5").is_file()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_restore_with_verify_warns_where_nothing_was_recorded(home, saved, kind):
    """`verify=True` on a source without checksums restores, but says that nothing was checked."""
    _, references = saved
    architecture = KINDS[kind][1]
    model = BUILD[architecture]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras_orbax.restore_sharded(model, KINDS[kind][0], verify=True)
    _assert_values(model, references[architecture])
    said = [str(w.message) for w in caught if issubclass(w.category, KerasOrbaxWarning)]
    said = [s for s in said if "verify=True" in s]  # not the one-device or optimizer warnings
    if kind == "keras-orbax":
        assert not said
    else:
        assert len(said) == 1 and "checksum" in said[0], said


@pytest.mark.parametrize(
    ("inside", "passes"),
    [(f"{STEP}/state", "a folder"), (f"{STEP}/state/layers.dense.vars.0", "an array directory")],
)
def test_a_location_inside_a_step_says_what_to_pass(home, inside, passes):
    location = f"orbax_ckpt/{inside}"
    assert (home / location).is_dir()
    for verb in (
        lambda: keras_orbax.inspect(location),
        lambda: keras_orbax.verify(location),
        lambda: keras_orbax.restore_sharded(cli_models.mlp(), location),
        lambda: keras_orbax.load_model(location),
    ):
        with pytest.raises(CheckpointNotFoundError) as raised:
            verb()
        assert f"is {passes} inside step {STEP}" in str(raised.value)
        assert f"'{home / 'orbax_ckpt'}@{STEP}'" in str(raised.value)


def test_a_step_named_twice_differently_is_refused(home):
    with pytest.raises(ValueError, match=f"names step {STEP}, but step=1"):
        keras_orbax.inspect(f"orbax_ckpt/{STEP}", step=1)


def test_every_verb_in_a_bucket(saved, bucket, capsys, distribution):
    """`gs://` and `s3://`: the same answers as the local directory, however the URL is spelled."""
    root, references = saved
    local = keras_orbax.inspect(root / "orbax_ckpt")
    url = f"{bucket}/ckpt"
    convert(root / "orbax_ckpt" / str(STEP), url, step=STEP)
    _distribute(distribution, "mlp")
    for location in (url, f"{url}/", f"{url}/{STEP}", f"{url}@{STEP}"):
        info = keras_orbax.inspect(location)
        assert (info.kind, info.step) == ("keras-orbax", STEP)
        assert _listing("keras-orbax", info) == _listing("keras-orbax", local)
        assert keras_orbax.verify(location).intact
        assert diff(location, root / "orbax_ckpt", values=True).identical
        with keras_orbax.deferred_init():
            model = cli_models.mlp()
        assert plan_restore_report(model, location).problems == []
        keras_orbax.restore_sharded(model, location)
        _assert_values(model, references["mlp"])
        _assert_values(keras_orbax.load_model(location), references["mlp"])
        assert _cli(capsys, "verify", location)[0] == 0
        assert _cli(capsys, "diff", location, str(root / "orbax_ckpt"))[0] == 0
