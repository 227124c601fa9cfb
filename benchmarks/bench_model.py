"""Shared pieces of the keras-orbax benchmarks: environment, model, distribution, memory.

Import this module only after `set_env()` has run (or call `set_env()` before anything imports
jax): XLA reads `XLA_FLAGS` once, when jax initializes its backend.

The model is an Embedding (vocab = width), a LayerNormalization, `layers` Dense(width, relu) blocks
and a Dense(1) head, compiled with Adam. Its width is chosen so that its float32 parameters take
about `params_gib` GiB; Adam doubles that with its two slots per trainable variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH_SHAPE = (2, 4)
MESH_AXES = ("batch", "model")
SEQ_LEN = 8
BATCH = 8


def set_env(cpu_devices: int | None = 8) -> None:
    """Sets the JAX/Keras environment; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("set_env() must run before jax is imported")
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flag = f"--xla_force_host_platform_device_count={cpu_devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)  # keras_orbax from the working tree


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    params_gib: float = 1.0
    layers: int = 15

    @property
    def width(self) -> int:
        """Width w with (layers + 1) * w * w float32 parameters ~ params_gib (a multiple of 32,
        which every mesh axis here divides)."""
        params = self.params_gib * 2**30 / 4
        return max(32, round(math.sqrt(params / (self.layers + 1)) / 32) * 32)

    @property
    def tag(self) -> str:
        return f"p{self.params_gib:g}_l{self.layers}"

    def n_params(self) -> int:
        w = self.width
        return w * w + 2 * w + self.layers * (w * w + w) + w + 1


def layout_rules() -> dict[str, tuple]:
    """LayoutMap rules (regex on variable path -> mesh axes); everything else is replicated."""
    return {
        r"block_\d+/kernel": ("batch", "model"),
        "embed/embeddings": (None, "model"),
    }


def make_distribution(devices=None, mesh_shape=MESH_SHAPE, axes=MESH_AXES, rules=None):
    import jax
    import keras

    devices = list(devices if devices is not None else jax.devices())
    if math.prod(mesh_shape) != len(devices):
        # On one accelerator chip (`--set cpu_devices=0`) every axis but the last has size 1,
        # so the same layout rules apply and each device holds the whole model.
        mesh_shape = (*[1] * (len(mesh_shape) - 1), len(devices))
    mesh = keras.distribution.DeviceMesh(mesh_shape, axes, devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, value in (rules if rules is not None else layout_rules()).items():
        layout_map[key] = value
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=axes[0])


def build_model(spec: ModelSpec, optimizer=None, build_optimizer: bool = True):
    """Builds and compiles the model (and Adam's slots). Set the distribution first.

    Under `keras_orbax.deferred_init()` pass an optimizer made outside the scope: an optimizer's
    `iteration` and `learning_rate` variables come from numbers, which a deferred scope refuses.
    """
    import keras
    from keras import layers

    w = spec.width
    tokens = keras.Input((SEQ_LEN,), dtype="int32", name="tokens")
    x = layers.Embedding(w, w, name="embed")(tokens)
    x = layers.LayerNormalization(name="norm")(x)
    for i in range(spec.layers):
        x = layers.Dense(w, activation="relu", name=f"block_{i}")(x)
    out = layers.Dense(1, name="head")(x)
    model = keras.Model(tokens, out, name="bench")
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3), loss="mse")
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    return model


def embedding(rows: int, cols: int, axes: tuple, mesh_shape=(8,), mesh_axes=("model",)):
    """One Embedding(rows, cols) named "embed", its table laid out `axes` over the mesh (set as
    the distribution here): the 256 MiB array of the restore and save benchmarks at full size."""
    import keras

    rules = {"embed/embeddings": axes}
    keras.distribution.set_distribution(make_distribution(None, mesh_shape, mesh_axes, rules))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, cols, name="embed")(tokens))


def independent_dense(layers: int, width: int):
    """`layers` independent Dense(width) layers in one model, built: many small variables (a
    Sequential this deep exceeds Python's recursion limit when it builds). Set the distribution
    first. The 5000-variable model of save_benchmark.py --many and many_restore_benchmark.py."""
    import keras

    class Blocks(keras.Model):
        def __init__(self, blocks):
            super().__init__(name="blocks")
            self.blocks = blocks

        def call(self, x):
            return x

    model = Blocks([keras.layers.Dense(width) for _ in range(layers)])
    for block in model.blocks:
        block.build((None, width))
    model.built = True
    return model


def sample_batch(spec: ModelSpec, seed: int = 1):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, spec.width, (BATCH, SEQ_LEN)).astype("int32")
    y = rng.standard_normal((BATCH, SEQ_LEN, 1)).astype("float32")
    return x, y


def state_variables(model) -> list:
    """The variables a restore fills: the model's and the optimizer's."""
    return list(model.variables) + list(model.optimizer.variables)


def resident_bytes(arrays) -> int:
    """Bytes on all devices together, replicas counted: sum of every addressable shard's bytes."""
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards)


def checksums(named_arrays) -> dict[str, float]:
    """{name: float64 sum} of each array, computed on the host one array at a time."""
    import jax
    import numpy as np

    return {k: float(np.sum(jax.device_get(a), dtype=np.float64)) for k, a in named_arrays}


def compare_checksums(got: dict, want: dict, rtol: float = 1e-9) -> list[str]:
    """Names missing from `got` or whose sum differs from `want` (a bit-exact restore gives the
    very same float64 sum: numpy sums the host copy in a fixed order)."""
    bad = []
    for name, value in want.items():
        if name not in got or not math.isclose(got[name], value, rel_tol=rtol):
            bad.append(name)
    return bad


def compare_checksum_values(got: dict, want: dict, rtol: float = 1e-9) -> list[str]:
    """Like `compare_checksums` for differently named arrays: each wanted sum must match a
    distinct restored one."""
    left = sorted(got.values())
    bad = []
    for name, value in want.items():
        hit = next((i for i, g in enumerate(left) if math.isclose(g, value, rel_tol=rtol)), None)
        if hit is None:
            bad.append(name)
        else:
            left.pop(hit)
    return bad


def read_all(path: str, threads: int = 8) -> list:
    """Every file under `path` (or the file `path`) read into fresh numpy buffers by `threads`
    threads, one read(2) per file: the read floor of a restore. Returns the buffers."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from benchmarks.harness import files_of

    files = [path] if os.path.isfile(path) else files_of(path)

    def read(name: str):
        buf = np.empty(os.path.getsize(name), np.uint8)
        with open(name, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        return buf

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(read, files))


def write_all(buffers, directory: str, threads: int = 8) -> None:
    """Each buffer to its own new file under `directory`, written and fsync-ed by `threads`
    threads: the durable write floor of a save."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    os.makedirs(directory)

    def write(job) -> None:
        i, data = job
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
        fd = os.open(os.path.join(directory, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, enumerate(buffers)))


def write_one_file(buffers, path: str, threads: int = 8) -> None:
    """The buffers back to back in one new file, each written at its offset by one of `threads`
    threads, then fsync-ed: the durable write floor of a format that is one file (a `.weights.h5`,
    a `model.safetensors`), where the filesystem serializes writes to one inode."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    views = [memoryview(np.ascontiguousarray(b).reshape(-1).view(np.uint8).data) for b in buffers]
    offsets = [0]
    for view in views[:-1]:
        offsets.append(offsets[-1] + len(view))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def write(job) -> None:
        view, offset = job
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, zip(views, offsets, strict=True)))
        os.fsync(fd)
    finally:
        os.close(fd)


def peak_growth(action) -> int | None:
    """The rise of peak RSS over RSS while `action()` ran (`tests._rss.peak_growth`); None where
    the kernel does not let the peak be reset (gVisor has no `clear_refs`): the action still runs."""
    from tests._rss import peak_growth as measured

    try:
        return measured(action)
    except OSError:
        action()
        return None


def clock() -> tuple[float, float]:
    """(wall, process CPU) seconds now; `since(clock())` gives both elapsed."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - start[0], time.process_time() - start[1]


def read_status_kib(field: str) -> int:
    """A `VmRSS`/`VmHWM`-style field of /proc/self/status, in KiB (the tests' own reader)."""
    if REPO_ROOT not in sys.path:  # as `set_env` puts it, for a caller that has not run it
        sys.path.insert(0, REPO_ROOT)
    from tests._rss import status_kib

    return status_kib(field)


def rss_bytes() -> int:
    return read_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak RSS of this process since it started (VmHWM); it cannot be reset."""
    return read_status_kib("VmHWM") * 1024
