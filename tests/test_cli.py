"""The `keras-orbax` command line on real Keras files and checkpoints: as a real subprocess where
the process matters (exit codes and one-line errors, no backend set, a terminal, peak memory), its
`main` in this process otherwise (the same code, without a Python start per command)."""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax import cli
from tests import cli_models

ROOT = Path(__file__).resolve().parents[1]


# The command line prints keras-orbax's warnings as its own lines, which these tests read: shown,
# not filtered as pyproject.toml filters them for the rest of the suite.
pytestmark = pytest.mark.filterwarnings("default::keras_orbax.errors.KerasOrbaxWarning")


def _run(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "keras_orbax", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    if check is not None:
        assert done.returncode == check, done.stdout + done.stderr
    return done


def _main(capsys: pytest.CaptureFixture, *args: str, check: int = 0) -> subprocess.CompletedProcess:
    """`keras_orbax.cli.main(args)` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert code == check, out + err
    return subprocess.CompletedProcess(args, code, out, err)


def _trained_mlp() -> keras.Model:
    model = cli_models.mlp()
    rng = np.random.default_rng(0)
    for variable in model.weights:
        variable.assign(rng.standard_normal(variable.shape).astype("float32"))
    return model


def test_the_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["keras-orbax"] == "keras_orbax.cli:main"
    assert "rich" not in " ".join(project["dependencies"])


def test_convert_a_weights_file_then_diff_it_and_inspect_it(tmp_path, capsys):
    h5 = tmp_path / "m.weights.h5"
    trained = _trained_mlp()
    trained.save_weights(h5)
    _main(capsys, "convert", str(h5), str(tmp_path / "ckpt"), "--step", "3")

    expected = cli_models.mlp()
    expected.load_weights(h5)  # Keras's own loader is the oracle
    restored = cli_models.mlp()
    keras_orbax.restore_sharded(restored, tmp_path / "ckpt")
    for got, want in zip(restored.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))

    same = _main(capsys, "diff", str(h5), f"{tmp_path / 'ckpt'}@3", "--values")
    assert "4 common variables compared (keys, shapes, dtypes and values): identical" in same.stdout

    # A change of 1e-6 in one value is found, and printed with enough digits to see it.
    changed = cli_models.mlp()
    changed.load_weights(h5)
    kernel = np.asarray(changed.get_layer("head").kernel.value).copy()
    kernel[3, 5] = np.float32(1.0)
    changed.get_layer("head").kernel.assign(kernel)
    keras_orbax.save(changed, tmp_path / "ckpt", step=4)
    kernel[3, 5] = np.float32(1.0 + 1e-6)
    changed.get_layer("head").kernel.assign(kernel)
    keras_orbax.save(changed, tmp_path / "ckpt", step=5)
    differ = _main(
        capsys, "diff", f"{tmp_path / 'ckpt'}@4", f"{tmp_path / 'ckpt'}@5", "--values", check=1
    )
    found = re.search(r"~ layers/dense_1/vars/0  max \|a - b\| = (\S+)", differ.stdout)
    assert found and float(found.group(1)) == pytest.approx(9.5367431640625e-07, rel=1e-6)
    assert "differ" in differ.stdout.splitlines()[-1]
    inputs = keras.Input((16,))
    x = keras.layers.Dense(4)(keras.layers.Dense(32)(inputs))
    other = tmp_path / "other.weights.h5"
    keras.Model(inputs, keras.layers.Dense(2)(x)).save_weights(other)
    keys = _main(capsys, "diff", f"{tmp_path / 'ckpt'}@5", str(other), check=1)
    assert "! layers/dense_1/vars/0  (32, 8) float32 -> (32, 4) float32" in keys.stdout
    assert f"+ layers/dense_2/vars/0  (only in {other})" in keys.stdout

    shown = json.loads(
        _main(capsys, "inspect", str(tmp_path / "ckpt"), "--step", "3", "--json").stdout
    )
    assert [s["step"] for s in shown["steps"]] == [3, 4, 5]
    kernel_entry = shown["variables"][0]
    assert (kernel_entry["key"], kernel_entry["shape"], kernel_entry["nbytes"]) == (
        "layers/dense/vars/0",
        [16, 32],
        16 * 32 * 4,
    )


@pytest.mark.parametrize("batch_bytes", [1, 1 << 30])
def test_diff_values_read_in_batches_find_each_change(tmp_path, monkeypatch, batch_bytes):
    """One variable per read or all in one: the same maximum differences, key by key."""
    from keras_orbax._src.sources import base

    monkeypatch.setattr(base, "READ_BATCH_BYTES", batch_bytes)
    model = cli_models.mlp()
    keras_orbax.save(model, tmp_path, step=1)
    for i, variable in enumerate(model.weights[:2]):
        variable.assign(variable.value + (i + 1) * 0.5)
    keras_orbax.save(model, tmp_path, step=2)
    result = keras_orbax.diff(f"{tmp_path}@1", f"{tmp_path}@2", values=True)
    assert len(result.max_abs_diff) == len(model.weights)
    changed = {key: d for key, d in result.max_abs_diff.items() if d}
    assert sorted(changed.values()) == pytest.approx([0.5, 1.0])


def test_errors_are_one_line_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nope.weights.h5"
    done = _run("convert", str(missing), str(tmp_path / "out"), check=2)
    assert done.stderr.count("\n") == 1 and str(missing) in done.stderr
    assert "Traceback" not in done.stderr
    quiet = _main(capsys, "inspect", str(tmp_path / "nothing"), "--quiet", check=2)
    assert quiet.stdout == "" and str(tmp_path / "nothing") in quiet.stderr


def test_plan_reports_bytes_per_device_and_process_without_reading(tmp_path, capsys):
    keras_orbax.save(_trained_mlp(), tmp_path / "ckpt", step=1)
    args = ["plan", str(tmp_path / "ckpt"), "--model", "tests.cli_models:mlp", "--mesh", "2x4"]
    args += ["--layout-map", "tests.cli_models:layout_map", "--processes", "2", "--json"]
    report = json.loads(_run(*args).stdout)
    assert report["problems"] == [] and report["reads"] == 4
    # Kernels (16, 32) and (32, 8) split 2 x 4 ways; biases replicated on all 8 devices.
    per_device = (16 * 32 + 32 * 8) * 4 // 8 + (32 + 8) * 4
    assert list(report["device_bytes"].values()) == [per_device] * 8
    # Process 0 holds devices 0-3: the batch half 0 of each kernel, and one copy of each bias.
    assert report["process_bytes"] == {"0": (16 * 32 + 32 * 8) * 4 // 2 + (32 + 8) * 4} | {
        "1": (16 * 32 + 32 * 8) * 4 // 2 + (32 + 8) * 4
    }
    wrong = _main(
        capsys, "plan", str(tmp_path / "ckpt"), "--model", "tests.cli_models:wide", check=1
    )
    assert "would fail" in wrong.stdout and "missing" in wrong.stdout


def test_plan_refuses_a_mesh_or_a_process_count_there_cannot_be(tmp_path, capsys):
    keras_orbax.save(_trained_mlp(), tmp_path / "ckpt", step=1)
    plan = ["plan", str(tmp_path / "ckpt"), "--model", "tests.cli_models:mlp"]
    usage = {
        "--mesh 0x4": "argument --mesh: must look like 2x4. Received: '0x4'",
        "--mesh 2x4 --processes 0": "argument --processes: must be a whole number of 1 or more",
    }
    for arguments, says in usage.items():
        with pytest.raises(SystemExit) as exited:  # argparse's usage error
            cli.main([*plan, *arguments.split()])
        assert exited.value.code == 2 and says in capsys.readouterr().err
    alone = _main(capsys, *plan, "--axes", "batch,model", check=2)
    assert "--axes names the axes of --mesh" in alone.stderr
    uneven = _run(*plan, "--mesh", "2x4", "--processes", "3", check=2)
    assert "processes must divide the 8 devices" in uneven.stderr


def test_convert_a_keras_orbax_checkpoint_directory_with_a_model(tmp_path, capsys):
    trained = _trained_mlp()
    trained.compile(optimizer="adam", loss="mse")
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path / "keras"), save_on_background=False)
    x, y = np.ones((8, 16), "float32"), np.ones((8, 8), "float32")
    trained.fit(x, y, epochs=1, verbose=0, callbacks=[callback])
    # The step holds its model config: no --model needed (as load_model of it needs none).
    by_config = _main(capsys, "convert", str(tmp_path / "keras"), str(tmp_path / "by_config"))
    assert by_config.stderr == ""  # compiled from the config: the optimizer state is kept
    kept = keras_orbax.inspect(tmp_path / "by_config").record.variables
    assert sum(key.startswith("optimizer/") for key in kept) == 10  # Adam: 2 counters, 8 slots
    uncompiled = _main(
        capsys,
        "convert",
        str(tmp_path / "keras"),
        str(tmp_path / "ckpt"),
        "--model",
        "tests.cli_models:mlp",
    )
    # The function builds no optimizer: its state is not written, and the warning says so in one
    # line, with what to do.
    (warning,) = uncompiled.stderr.strip().splitlines()
    assert warning.startswith("keras-orbax convert: warning: Model ")
    assert "has no optimizer, so 10 optimizer variables" in warning and "not written" in warning
    assert "convert without a model" in warning
    assert "compile it in --model's function with an optimizer made outside the function" in warning
    # A function that compiles with an optimizer it makes cannot run deferred: the error says how
    # to keep the optimizer; made at module level, the optimizer's state is converted.
    inside = _main(capsys, "convert", str(tmp_path / "keras"), str(tmp_path / "inside"),
                   "--model", "tests.cli_models:mlp_compiled", check=cli.EXIT_ERROR)  # fmt: skip
    assert "--model tests.cli_models:mlp_compiled compiles the model" in inside.stderr
    assert "Make the optimizer outside the function, at module level" in inside.stderr
    assert "with` block" not in inside.stderr  # the Python API's advice
    outside = _main(capsys, "convert", str(tmp_path / "keras"), str(tmp_path / "outside"),
                    "--model", "tests.cli_models:mlp_compiled_with_module_optimizer")  # fmt: skip
    assert outside.stderr == ""
    kept = keras_orbax.inspect(tmp_path / "outside").record.variables
    assert sum(key.startswith("optimizer/") for key in kept) == 10
    for converted in ("by_config", "ckpt", "outside"):
        restored = cli_models.mlp()
        keras_orbax.restore_sharded(restored, tmp_path / converted)
        for got, want in zip(restored.weights, trained.weights, strict=True):
            np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def _wide_weights(tmp_path: Path) -> Path:
    h5 = tmp_path / "wide.weights.h5"
    model = cli_models.wide()
    rng = np.random.default_rng(1)
    for variable in model.weights:
        variable.assign(rng.standard_normal(variable.shape).astype("float32"))
    model.save_weights(h5)
    return h5


def test_convert_streams_one_array_at_a_time(tmp_path):
    """A fresh process converts a 64 MiB file (8 x 8 MiB); its peak RSS grows by well under the
    model (< 3 variables), after a warm-up conversion of a tiny file took Orbax's fixed costs."""
    h5 = _wide_weights(tmp_path)
    small = tmp_path / "small.weights.h5"
    _trained_mlp().save_weights(small)
    script = f"""
import json, resource
from keras_orbax._src.tools.convert import convert
convert({str(small)!r}, {str(tmp_path / "warm")!r})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert({str(h5)!r}, {str(tmp_path / "ckpt")!r})
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"growth": (after - before) * 1024}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    variable = 8 * 2**20
    assert growth < 3 * variable, f"peak RSS grew {growth / 2**20:.1f} MiB"
    restored = cli_models.wide()
    keras_orbax.restore_sharded(restored, tmp_path / "ckpt")
    expected = cli_models.wide()
    expected.load_weights(h5)
    for got, want in zip(restored.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def test_progress_shows_on_a_terminal_and_not_with_quiet(tmp_path):
    h5 = _wide_weights(tmp_path)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # One process on a terminal runs each command in turn (one start instead of six).
    shown, hidden, checked, unchecked, restored, silent = _on_terminal(
        ["convert", str(h5), a],
        ["convert", str(h5), b, "--quiet"],
        ["verify", a],
        ["verify", a, "--quiet"],
        ["restore", str(h5), "1"],
        ["restore", str(h5), "0"],
    )
    assert "64.0 MiB" in shown and re.search(r"B/s", shown), shown
    assert "MiB" not in hidden and "wrote" not in hidden, hidden
    assert re.search(r"(?s)verify.*64\.0.*MiB.*B/s", checked), checked
    assert "MiB" not in unchecked, unchecked
    assert re.search(r"(?s)restore_sharded.*64\.0.*MiB.*B/s", restored), restored
    assert "MiB" not in silent, silent


_ON_TERMINAL = """
import json, sys, keras_orbax
from keras_orbax import cli
from tests import cli_models

for args in json.loads(sys.argv[1]):
    if args[0] == "restore":  # the API's progress: restore_sharded(verbose=...)
        keras_orbax.restore_sharded(cli_models.wide(), args[1], verbose=int(args[2]))
    elif cli.main(args) != 0:
        sys.exit(1)
    sys.stderr.flush()
    print("\\n<end of command>", flush=True)
"""


def _on_terminal(*commands: list[str]) -> list[str]:
    """Runs each command line (`["restore", path, verbose]`: `restore_sharded`) in one Python
    process whose stdout and stderr are a pseudo-terminal; what each one showed."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax", "COLUMNS": "120"}
    env.pop("XLA_FLAGS", None)
    process = subprocess.Popen(
        [sys.executable, "-c", _ON_TERMINAL, json.dumps(commands)],
        stdout=follower,
        stderr=follower,
        cwd=ROOT,
        env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    output = b"".join(chunks).decode(errors="replace")
    assert process.wait() == 0, output
    shown = output.split("<end of command>")
    assert len(shown) == len(commands) + 1, output
    return shown[:-1]


def test_verify_catches_a_flipped_byte_and_needs_no_backend_setting(tmp_path):
    model = _trained_mlp()
    keras_orbax.save(model, tmp_path / "ckpt", step=3)
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    command = [sys.executable, "-m", "keras_orbax", "verify", str(tmp_path / "ckpt")]
    intact = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert intact.returncode == 0, intact.stderr
    assert intact.stdout.startswith(f"step 3 of '{tmp_path / 'ckpt'}' intact:")
    state = tmp_path / "ckpt" / "3" / "state"
    shard = next(
        p for p in state.glob("layers.*.vars.0/**/*") if p.is_file() and p.name != "zarr.json"
    )
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x10
    shard.write_bytes(bytes(data))
    damaged = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert damaged.returncode != 0
    assert len(damaged.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert "checksum" in damaged.stderr and str(shard) in damaged.stderr


def test_inspect_shows_the_metrics_the_callback_stored_with_each_step(tmp_path, capsys):
    model = _trained_mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    callback = keras_orbax.ModelCheckpoint(
        tmp_path / "ckpt", max_to_keep=None, save_on_background=False
    )
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 8), "float32")
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[callback])
    shown = json.loads(_main(capsys, "inspect", str(tmp_path / "ckpt"), "--json").stdout)
    assert [s["step"] for s in shown["steps"]] == [1, 2]
    for summary, loss, mae in zip(
        shown["steps"], history.history["loss"], history.history["mae"], strict=True
    ):
        assert summary["metrics"] == {"loss": pytest.approx(loss), "mae": pytest.approx(mae)}
    table = _main(capsys, "inspect", str(tmp_path / "ckpt")).stdout
    assert f"loss={history.history['loss'][1]:.6g}" in table


def test_convert_json_names_the_step_and_its_bytes(tmp_path, capsys):
    h5 = tmp_path / "m.weights.h5"
    _trained_mlp().save_weights(h5)
    nbytes = (16 * 32 + 32 + 32 * 8 + 8) * 4
    done = _main(capsys, "convert", str(h5), str(tmp_path / "ckpt"), "--step", "3", "--json")
    assert json.loads(done.stdout) == {
        "step_dir": str(tmp_path / "ckpt" / "3"),
        "step": 3,
        "bytes": nbytes,
    }
    text = _main(capsys, "convert", str(h5), str(tmp_path / "other"))
    assert text.stdout == f"wrote {tmp_path / 'other' / '0'} (3.2 KiB)\n"  # 3,232 B
    assert keras_orbax.inspect(tmp_path / "ckpt").nbytes == nbytes


def test_a_mismatch_is_one_line_of_sentences(tmp_path, capsys):
    """A multi-line error (the mismatch report) is joined as sentences, with the advice that fits
    the subcommand: convert writes nothing, and has no strict=False to suggest."""
    _trained_mlp().save_weights(tmp_path / "m.weights.h5")
    failed = _main(
        capsys,
        "convert",
        str(tmp_path / "m.weights.h5"),
        str(tmp_path / "ckpt"),
        "--model",
        "tests.cli_models:wide",
        check=2,
    )
    (line,) = failed.stderr.strip().splitlines()
    assert ".;" not in line and ":;" not in line
    assert "problems. " in line and "Nothing was written" in line
    assert "strict=False" not in line
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_damaged_file_is_one_line_of_sentences(tmp_path, capsys):
    keras_orbax.save(_trained_mlp(), tmp_path / "ckpt", step=1)
    array = tmp_path / "ckpt" / "1" / "state" / "layers.dense.vars.0"
    shard = next(p for p in array.rglob("c*") if p.is_file())
    shard.write_bytes(shard.read_bytes()[:-7])
    failed = _main(capsys, "verify", str(tmp_path / "ckpt"), check=2)
    (line,) = failed.stderr.strip().splitlines()
    assert "1 array file failed: layers/dense/vars/0: " in line, line
    assert line.endswith("(truncated or overwritten)."), line  # verify modifies no model
    assert ".." not in line and "No variable was modified" not in line


def test_a_failed_convert_leaves_no_directory_it_made(tmp_path, capsys):
    keras_orbax.save(_trained_mlp(), tmp_path / "ckpt", step=1)
    # An array's zarr.json damaged: the array goes to Orbax's reader, which fails once the
    # destination's directory has been made.
    (tmp_path / "ckpt" / "1" / "state" / "layers.dense.vars.0" / "zarr.json").write_text("{")
    failed = _main(capsys, "convert", str(tmp_path / "ckpt"), str(tmp_path / "new"), check=2)
    assert "layers/dense/vars/0" in failed.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a directory that was there before is left there
    _main(capsys, "convert", str(tmp_path / "ckpt"), str(tmp_path / "kept"), check=2)
    assert (tmp_path / "kept").is_dir()


def test_another_librarys_error_is_one_line_naming_the_location():
    """s3fs's own error names no path ("Unable to locate credentials"), and botocore logs its
    retries: the command says the error in one line, with the location it was given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "XLA_FLAGS"}
    env |= {
        "PYTHONPATH": str(ROOT),
        "KERAS_BACKEND": "jax",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance to ask for credentials
    }
    url = "s3://keras-orbax-no-such-bucket/ckpt"
    command = [sys.executable, "-m", "keras_orbax", "verify", url]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("keras-orbax verify: error: ")
    assert f"(location given: '{url}')" in line


def test_main_in_process_leaves_the_callers_logging_and_warnings_as_they_were(tmp_path, capsys):
    absl = logging.getLogger("absl")
    before = absl.level
    absl.setLevel(logging.INFO)
    filters = list(warnings.filters)
    try:
        _main(capsys, "inspect", "-q", str(tmp_path / "missing"), check=cli.EXIT_ERROR)
        assert absl.level == logging.INFO  # main quiets absl only while it runs
        assert logging.getLogger("s3fs").level == logging.NOTSET  # and the stores' loggers
        assert warnings.filters == filters  # and -q ignores warnings only while it runs
    finally:
        absl.setLevel(before)
