"""keras-orbax in one minute, on 8 virtual CPU devices.

1. A fresh process trains a small model under `ModelParallel` on a (2, 4) mesh; the `ModelCheckpoint`
   callback saves sharded checkpoints as it goes.
2. Another fresh process builds the same model under `deferred_init()` (nothing is allocated) on a
   different mesh, (4, 2), restores it with `restore_sharded`, and prints what each device read.

Run: `python examples/demo.py [--directory DIR]`. Each phase runs in its own process, as after a restart.
Without `--directory`, the checkpoint goes to a temporary directory, removed at the end; a `DIR` given is
kept, and a second run into it resumes from its checkpoint (`resume=True`) instead of training again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

PHASES = ("train", "restore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=None, help="checkpoint root (default: a temp dir)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        _run_phase(args.phase, args.directory)
        return
    directory = args.directory or tempfile.mkdtemp(prefix="keras-orbax-demo-")
    try:
        for phase in PHASES:
            print(f"\n=== {phase} (a fresh process) ===", flush=True)
            command = [sys.executable, __file__, "--phase", phase, "--directory", directory]
            subprocess.run(command, check=True)
    finally:
        if args.directory is None:  # ours: nothing of the user's is in it
            shutil.rmtree(directory, ignore_errors=True)


def _run_phase(phase: str, directory: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import keras  # noqa: F401  (after the environment is set)

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
    layout_map["embedding/embeddings"] = (None, "model")
    return ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _build():
    import keras

    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(64, 32, name="embedding")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu", name="dense_in")(x)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(8, name="dense_out")(x)
    model = keras.Model(inputs, outputs, name="demo")
    return model


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, 64, (256, 8)).astype("int32"), rng.random((256, 8)).astype("float32")


def _train(directory: str) -> None:
    import keras
    import numpy as np

    import keras_orbax

    distribution = _distribution((2, 4))
    keras.distribution.set_distribution(distribution)
    mesh = distribution.device_mesh
    print(f"training on mesh {mesh.shape} {mesh.axis_names} ({mesh.devices.size} devices)")
    keras.utils.set_random_seed(0)
    model = _build()
    model.compile(optimizer="adam", loss="mse")
    # resume=True: a second run into the same directory goes on from its checkpoint.
    checkpoint = keras_orbax.ModelCheckpoint(
        directory, monitor="loss", max_to_keep=2, verbose=1, resume=True
    )
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[checkpoint], verbose=2)
    np.save(os.path.join(directory, "expected.npy"), model.predict(x[:16], verbose=0))
    print(keras_orbax.inspect(directory))


def _restore(directory: str) -> None:
    import keras
    import numpy as np

    import keras_orbax

    distribution = _distribution((4, 2))  # another mesh than training's (2, 4)
    keras.distribution.set_distribution(distribution)
    mesh = distribution.device_mesh
    print(
        f"restoring onto mesh {mesh.shape} {mesh.axis_names} ({mesh.devices.size} devices; "
        "trained on mesh (2, 4))"
    )
    with keras_orbax.deferred_init():
        model = _build()  # no variable is allocated
    model.compile(optimizer="adam", loss="mse")
    result = keras_orbax.restore_sharded(model, directory)
    print(
        f"restored step {result.step} (epoch {result.epoch}): {len(result.restored)} variables, "
        f"{result.bytes_read} bytes read by this process"
    )
    _print_device_reads(model)
    x, _ = _data()
    expected = np.load(os.path.join(directory, "expected.npy"))
    np.testing.assert_allclose(model.predict(x[:16], verbose=0), expected, rtol=1e-5, atol=1e-6)
    print("predictions match the trained model's")


def _print_device_reads(model) -> None:
    """What each device holds now: the slices of each sharded variable it read."""
    per_device: dict[int, list[str]] = {}
    totals: dict[int, int] = {}
    for variable in model.variables + model.optimizer.variables:
        value = variable.value
        if value.ndim == 0 or value.sharding.is_fully_replicated:
            continue
        for shard in value.addressable_shards:
            region = ", ".join(
                f"{s.start or 0}:{s.stop or n}"
                for s, n in zip(shard.index, value.shape, strict=True)
            )
            per_device.setdefault(shard.device.id, []).append(f"{variable.path}[{region}]")
            totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    print("sharded variables, per device (replicated ones omitted):")
    for device in sorted(per_device):
        print(
            f"  device {device}: {totals[device]:>6} bytes  "
            + "  ".join(per_device[device][:3])
            + " ..."
        )


if __name__ == "__main__":
    main()
