"""What the command line and `import keras_orbax` load, the lazy public names, the one error for a
Keras on another backend, and a reader that closes the pipe early. Each process-level fact is
checked in a fresh Python process (this one has JAX and Keras loaded already); no timings are
asserted (`python -m benchmarks cli_startup` measures the figures)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest

import keras_orbax
from keras_orbax import cli, errors

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "keras", "orbax", "tensorstore", "numpy", "h5py")


def _python(script: str, **env_vars: str) -> subprocess.CompletedProcess:
    """`script` in a fresh process; KERAS_BACKEND unset unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env |= {"PYTHONPATH": str(ROOT), **env_vars}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def _last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_HELP_AND_IMPORTS = """
import contextlib, io, json, os, sys
import keras_orbax
import keras_orbax.errors
from keras_orbax import cli
import keras_orbax.__main__  # `python -m keras_orbax` imports this (its `main` runs only as __main__)

names = dir(keras_orbax)
help_texts = {}
for args in (["--help"], ["--version"],
             *([command, "--help"] for command in cli._parser()._actions[-1].choices)):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main(args)
        except SystemExit as done:
            assert done.code == 0, done.code
    help_texts[" ".join(args)] = out.getvalue()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"heavy": heavy, "backend": os.environ.get("KERAS_BACKEND"), "dir": names,
                  "help": help_texts}))
"""


def test_help_and_import_load_no_jax_keras_or_orbax():
    """A structural check: an eager import of JAX, Keras, Orbax, tensorstore or numpy anywhere on
    the path of `import keras_orbax`, `keras_orbax.errors`, `keras_orbax.cli` or `--help` fails."""
    shown = _last_json(_python(_HELP_AND_IMPORTS % (HEAVY,)))
    assert shown["heavy"] == []
    assert shown["backend"] == "jax"  # chosen at import, before anything imports Keras
    assert set(keras_orbax.__all__) <= set(shown["dir"])
    assert "keras-orbax" in shown["help"]["--help"]
    assert "--json" in shown["help"]["convert --help"]
    assert len(shown["help"]) == 7
    # The installed versions, as the packages record them (none of them imported).
    versions = [f"keras-orbax {keras_orbax.__version__}", f"keras {keras.__version__}"]
    versions.append(f"jax {importlib.metadata.version('jax')}")
    assert shown["help"]["--version"].startswith(f"{versions[0]} ({versions[1]}, {versions[2]},")


def test_a_backend_the_user_chose_is_kept():
    shown = _last_json(
        _python(
            "import os, json, keras_orbax; print(json.dumps(os.environ['KERAS_BACKEND']))",
            KERAS_BACKEND="numpy",
        )
    )
    assert shown == "numpy"


def test_public_names_load_on_first_use():
    from keras_orbax._src.tools.inspect_checkpoint import CheckpointInfo
    from keras_orbax._src.write.step_writer import save

    assert keras_orbax.save is save
    assert keras_orbax.CheckpointInfo is CheckpointInfo
    namespace: dict = {}
    exec(f"from keras_orbax import {', '.join(keras_orbax.__all__)}", namespace)
    for name in keras_orbax.__all__:
        assert namespace[name] is getattr(keras_orbax, name), name
    assert keras_orbax.errors is errors
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        _ = keras_orbax.nothing_here


def test_every_option_has_help_and_every_subcommand_json():
    parser = cli._parser()
    subcommands = parser._actions[-1]
    assert isinstance(subcommands, argparse._SubParsersAction)
    for name, sub in subcommands.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.dest} has no help text"
        assert any("--json" in a.option_strings for a in sub._actions), name


_OTHER_BACKEND = """
import keras  # with KERAS_BACKEND=numpy, before keras-orbax
import keras_orbax
from keras_orbax.errors import BackendError

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
try:
    keras_orbax.save(model, {directory!r}, step=1)
except BackendError as error:
    print(str(error))
else:
    print("saved")
"""


def test_keras_on_another_backend_is_one_clear_error(tmp_path):
    done = _python(_OTHER_BACKEND.format(directory=str(tmp_path / "ckpt")), KERAS_BACKEND="numpy")
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert "'numpy' backend" in message and "KERAS_BACKEND=jax" in message, message
    assert "Received: KERAS_BACKEND='numpy'" in message
    assert not (tmp_path / "ckpt").exists()
    # The command line says the same, in one line, exit 2.
    refused = _verify_under(tmp_path / "ckpt", "numpy")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "KERAS_BACKEND=jax" in refused.stderr
    assert "Traceback" not in refused.stderr


def _verify_under(location: Path, backend: str) -> subprocess.CompletedProcess:
    """`keras-orbax verify location` in a fresh process with KERAS_BACKEND=backend."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "keras_orbax", "verify", str(location)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": backend},
        timeout=300,
    )


def test_a_backend_chosen_but_not_installed_is_the_same_clear_error(tmp_path):
    """Keras would import the backend KERAS_BACKEND names: the error is keras-orbax's, not that
    backend's ImportError (torch is not installed here; the check runs before Keras is imported,
    so the answer is the same where it is)."""
    refused = _verify_under(tmp_path / "ckpt", "torch")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "KERAS_BACKEND chooses the 'torch' backend" in refused.stderr
    assert "KERAS_BACKEND=jax" in refused.stderr
    # Set but empty is unset to Keras: keras-orbax chooses JAX.
    shown = _last_json(
        _python(
            "import json, keras_orbax, keras; print(json.dumps(keras.backend.backend()))",
            KERAS_BACKEND="",
        )
    )
    assert shown == "jax"


def _checkpoint(tmp_path: Path) -> Path:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    return tmp_path / "ckpt"


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax"}


def test_a_reader_that_stops_early_ends_the_output_quietly(tmp_path):
    ckpt = _checkpoint(tmp_path)
    command = [sys.executable, "-m", "keras_orbax", "inspect", str(ckpt), "--json"]
    # The reader is gone before anything is written: every write meets a closed pipe.
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            command, stdout=writer, stderr=subprocess.PIPE, cwd=ROOT, env=_cli_env(), timeout=300
        )
    finally:
        os.close(writer)
    assert done.stderr.decode() == ""
    assert done.returncode == 0
    # As a shell runs it: `| head -1` gets the first line; nothing else is said; status 0.
    piped = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$@" | head -1', "bash", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_cli_env(),
        timeout=300,
    )
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, "{\n", "")


_INSPECT = """
import contextlib, io, json, sys
from keras_orbax import cli

with contextlib.redirect_stdout(io.StringIO()) as out:
    code = cli.main(["inspect", sys.argv[1], "--json"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "keras", "orbax", "tensorstore"})
print(json.dumps({"code": code, "heavy": heavy, "shown": json.loads(out.getvalue())}))
"""


def test_inspect_of_a_step_loads_no_jax_keras_orbax_or_tensorstore(tmp_path):
    """A structural check: `keras-orbax inspect` of a keras-orbax step (saved here, inspected in a
    fresh process) reads its record without JAX, Keras, Orbax or tensorstore; an eager import of
    any of them on that path (the sources `resolve` opens, the format, storage, compat) fails."""
    ckpt = _checkpoint(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _INSPECT, str(ckpt)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_cli_env(),
        timeout=300,
    )
    shown = _last_json(done)
    assert shown["heavy"] == []
    assert (shown["code"], shown["shown"]["kind"], shown["shown"]["step"]) == (0, "keras-orbax", 1)
    variables = {v["key"]: (v["shape"], v["dtype"]) for v in shown["shown"]["variables"]}
    assert variables == {
        "layers/dense/vars/0": ([4, 3], "float32"),
        "layers/dense/vars/1": ([3], "float32"),
        "layers/dense_1/vars/0": ([3, 2], "float32"),
        "layers/dense_1/vars/1": ([2], "float32"),
    }
