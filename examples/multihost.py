"""Multi-host keras-orbax on one machine: 2 processes train, 4 processes restore on another mesh.

Each process is a `jax.distributed` host with its own virtual CPU devices, talking over 127.0.0.1.

1. 2 processes x 4 devices train a model under `ModelParallel` on a (2, 4) mesh with the
   `ModelCheckpoint` callback; each process writes only the shards its devices own.
2. 4 processes x 2 devices rebuild the model under `deferred_init()` on a (4, 2) mesh, restore it
   with `restore_sharded` (each process reads only its shards and says how many bytes), and check
   that the model's outputs equal the trained model's.

Run: `python examples/multihost.py [--directory DIR]`. On a real cluster, run the same code on every host
with `jax.distributed.initialize(coordinator_address, num_processes, process_id)` and a directory that
every host can reach (a shared file system); see docs/multihost.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=None, help="checkpoint root (default: a temp dir)")
    parser.add_argument(
        "--worker", nargs=4, metavar=("PHASE", "ADDRESS", "COUNT", "ID"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        phase, address, count, process_id = args.worker
        _worker(phase, args.directory, address, int(count), int(process_id))
        return
    directory = args.directory or tempfile.mkdtemp(prefix="keras-orbax-multihost-")
    _launch("train", directory, processes=2, devices=4)
    _launch("restore", directory, processes=4, devices=2)


def _launch(phase: str, directory: str, processes: int, devices: int) -> None:
    """Starts `processes` local hosts with `devices` CPU devices each and waits for all of them."""
    print(f"\n=== {phase}: {processes} processes x {devices} devices ===", flush=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--directory",
                directory,
                "--worker",
                phase,
                address,
                str(processes),
                str(i),
            ],
            env=env,
        )
        for i in range(processes)
    ]
    codes = [worker.wait() for worker in reversed(workers)]  # process 0 hosts the coordinator
    if any(codes):
        raise SystemExit(f"{phase} failed: exit codes {codes[::-1]}")


def _worker(phase: str, directory: str, address: str, count: int, process_id: int) -> None:
    import jax
    import keras

    jax.distributed.initialize(address, count, process_id)
    keras.utils.set_random_seed(0)  # every process must initialize the same values
    if phase == "train":
        _train(directory)
    else:
        _restore(directory)


def _distribution(mesh_shape: tuple[int, int]):
    import jax
    from keras.distribution import DeviceMesh, LayoutMap, ModelParallel

    mesh = DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    layout_map = LayoutMap(mesh)
    layout_map["dense.*kernel"] = ("batch", "model")
    distribution = ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    distribution.auto_shard_dataset = False  # each process feeds its own rows of every batch
    return distribution


def _build():
    import keras

    inputs = keras.Input((32,))
    x = keras.layers.Dense(64, activation="relu", name="dense_in")(inputs)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(8, name="dense_out")(x)
    return keras.Model(inputs, outputs, name="multihost_demo")


def _local_rows(array, batch: int):
    """This process's rows of each global batch."""
    import jax

    per_process = batch // jax.process_count()
    start = jax.process_index() * per_process
    return [array[i + start : i + start + per_process] for i in range(0, len(array), batch)]


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.random((256, 32)).astype("float32"), rng.random((256, 8)).astype("float32")


def _outputs(model, x):
    """The model's outputs on `x`, computed across all processes and gathered on each."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    layout = jax.sharding.NamedSharding(
        model.layers[1].kernel.value.sharding.mesh, jax.sharding.PartitionSpec("batch")
    )
    local = _local_rows(x[:64], 64)[0]
    inputs = jax.make_array_from_process_local_data(layout, local, (64, 32))
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )

    @jax.jit
    def forward(trainable, non_trainable, batch):
        return model.stateless_call(trainable, non_trainable, batch)[0]

    return np.asarray(multihost_utils.process_allgather(forward(*state, inputs), tiled=True))


def _train(directory: str) -> None:
    import jax
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(_distribution((2, 4)))
    model = _build()
    model.compile(optimizer="adam", loss="mse")
    x, y = _data()
    batches = list(zip(_local_rows(x, 32), _local_rows(y, 32), strict=True))

    def data():
        while True:
            yield from batches

    checkpoint = keras_orbax.ModelCheckpoint(directory + "/ckpt", monitor="loss", verbose=1)
    verbose = 2 if jax.process_index() == 0 else 0
    model.fit(
        data(), epochs=3, steps_per_epoch=len(batches), callbacks=[checkpoint], verbose=verbose
    )
    outputs = _outputs(model, x)
    if jax.process_index() == 0:
        np.save(directory + "/expected_outputs.npy", outputs)


def _restore(directory: str) -> None:
    import jax
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(_distribution((4, 2)))  # another mesh and process count
    with keras_orbax.deferred_init():
        model = _build()
    result = keras_orbax.restore_sharded(model, directory + "/ckpt")
    distinct = [{repr(s.index): s for s in v.value.addressable_shards} for v in model.variables]
    owned = sum(s.data.nbytes for shards in distinct for s in shards.values())
    print(
        f"process {jax.process_index()}: restored step {result.step}, read {result.bytes_read} bytes "
        f"for the {owned} bytes of shards its devices own",
        flush=True,
    )
    x, _ = _data()
    outputs = _outputs(model, x)
    expected = np.load(directory + "/expected_outputs.npy")
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)
    if jax.process_index() == 0:
        print("outputs match the trained model's on every process", flush=True)


if __name__ == "__main__":
    main()
