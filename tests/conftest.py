"""Test set-up: 8 virtual CPU devices, the JAX backend, and a distribution fixture.

The environment is set here, before jax or keras is imported by any test module.
"""

import os
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache, shared by this session, its xdist workers and every subprocess
# the tests start (they inherit the environment), and kept between runs: most of the programs the
# tests compile (the same small models, trained and restored again and again) are the same in
# every process and every run. Thresholds at 0: each of these programs takes well under JAX's
# default of 1 s to compile, so none would be cached. A cache directory already set wins;
# `/.cache/` is ignored by git.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import keras
import pytest

N_DEVICES = 8
# The files that take longest (measured in a full `-n 2 --dist loadfile` run, longest first) are
# handed out first: `--dist loadfile` gives the workers whole files in collection order, and one of
# these started last would leave the other worker idle at the end. pytest-xdist (3.7 on) reorders
# the files by their number of tests unless told not to (`pytest_configure` below): that order
# left files of a few long tests (test_memory.py, test_incremental_objects.py, test_kill.py) last.
_LONGEST_FIRST = (
    "test_data_position.py",
    "test_fault_matrix.py",
    "test_export_transformers.py",
    "test_object_storage.py",
    "test_every_verb.py",
    "test_callback.py",
    "test_incremental_objects.py",
    "test_multihost.py",
    "test_training_matrix.py",
    "test_memory.py",
    "test_hostile_inputs.py",
    "test_layout_maps.py",
    "test_hub_tasks.py",
    "test_local_tier_multiprocess.py",
    "test_local_tier.py",
    "test_shared_directory.py",
    "test_quantization_matrix.py",
    "test_export_preset.py",
    "test_cli.py",
    "test_incremental.py",
    "test_user_day.py",
    "test_environment.py",
    "test_keras_parity.py",
    "test_docs.py",
    "test_export_h5.py",
    "test_callback_resume.py",
    "test_mapped_safety.py",
    "test_kill.py",
    "test_quantized_calibrated.py",
    "test_callback_keras_suite.py",
    "test_seed_preset.py",
    "test_keras_files.py",
    "test_hub_presets.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # Keep the collection order (`_LONGEST_FIRST`) in the `--dist loadfile` queue: pytest-xdist's
    # default reorders the files by how many tests each has.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):  # once a run, before any xdist worker writes entries
        _drop_empty_cache_entries(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    if keras.backend.backend() != "jax":
        raise pytest.UsageError(
            f"keras-orbax tests need KERAS_BACKEND=jax, got {keras.backend.backend()}"
        )
    if jax.device_count() < N_DEVICES:
        raise pytest.UsageError(
            f"keras-orbax tests need {N_DEVICES} devices, got {jax.device_count()}: "
            "XLA_FLAGS was set after jax initialized its backend."
        )


def _drop_empty_cache_entries(directory: Path) -> None:
    """JAX creates an entry's file, then writes it; a process killed in between (the tests
    SIGKILL workers) leaves an empty entry, which JAX warns about at every read and never writes
    again."""
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.is_file() and entry.stat().st_size == 0:
                entry.unlink(missing_ok=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


@pytest.fixture
def distribution():
    """Sets a distribution for one test and puts the previous one back.

    Usage: `distribution(dist)` inside the test.
    """
    previous = keras.distribution.distribution()

    def set_distribution(dist):
        keras.distribution.set_distribution(dist)
        return dist

    yield set_distribution
    keras.distribution.set_distribution(previous)


@pytest.fixture
def one_file_per_shard():
    """Saves in the test write one file per shard, small arrays too (`_models.one_file_per_shard`)."""
    from tests import _models

    with _models.one_file_per_shard():
        yield


# Object stores (tests/_object_stores.py): one local S3 and one GCS server per session, started
# by the first test that needs each; every test gets its own empty bucket.


def _store(kind: str, tmp_path_factory: pytest.TempPathFactory):
    from tests import _object_stores

    missing = _object_stores.missing_packages(kind)
    if missing:
        message = (
            f'the local {kind} server needs {", ".join(missing)}: pip install -e ".[test,cloud]"'
        )
        if _object_stores.required():
            pytest.fail(f"{message} ({_object_stores.REQUIRE_ENV} is set)")
        pytest.skip(message)
    store = _object_stores.start(kind, tmp_path_factory.mktemp(f"{kind}_server"))
    yield store
    _object_stores.stop(store)


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """moto's S3 server on 127.0.0.1, in memory, for the whole session."""
    yield from _store("s3", tmp_path_factory)


@pytest.fixture(scope="session")
def gcs_store(tmp_path_factory):
    """gcp-storage-emulator (patched for tensorstore) on 127.0.0.1, in memory, for the session."""
    yield from _store("gcs", tmp_path_factory)


@pytest.fixture(params=["s3", "gcs"])
def store(request, monkeypatch):
    """Each local object store in turn, with this test's environment pointed at it."""
    chosen = request.getfixturevalue(f"{request.param}_store")
    chosen.use(monkeypatch)
    return chosen


@pytest.fixture
def bucket(store) -> str:
    """A fresh empty bucket in each store in turn: `s3://…`, then `gs://…`."""
    return store.new_bucket()


@pytest.fixture
def s3_bucket(s3_store, monkeypatch) -> str:
    """A fresh empty S3 bucket (`s3://…`), with this test's environment pointed at its server."""
    s3_store.use(monkeypatch)
    return s3_store.new_bucket()


@pytest.fixture
def gcs_bucket(gcs_store, monkeypatch) -> str:
    """A fresh empty GCS bucket (`gs://…`), with this test's environment pointed at its server."""
    gcs_store.use(monkeypatch)
    return gcs_store.new_bucket()
