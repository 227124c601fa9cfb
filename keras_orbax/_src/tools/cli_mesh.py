"""`--mesh`, `--axes`, `--layout-map`: the distribution a `keras-orbax` command restores a model
under, on virtual CPU devices. JAX and Keras are imported only once a command runs under one."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

from keras_orbax._src.tools.cli_user_code import load_function


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """`--mesh`, `--axes`, `--layout-map`: the distribution a command restores a model under."""
    parser.add_argument(
        "--mesh",
        type=mesh_argument,
        default=None,
        help="device mesh shape, e.g. 2x4 (virtual CPU devices)",
    )
    parser.add_argument("--axes", default=None, help="mesh axis names, e.g. batch,model")
    parser.add_argument(
        "--layout-map", default=None, help="MODULE:FUNCTION(device_mesh) -> LayoutMap"
    )


def mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"must look like 2x4. Received: {text!r}")
    return shape


def mesh_argument(text: str) -> str:
    """`--mesh`, checked as argparse parses it: a bad one is a usage error (exit 2)."""
    mesh_shape(text)
    return text


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with `--axes` or `--layout-map` given without `--mesh`; None if nothing."""
    for option, says in (
        ("axes", "--axes names the axes of --mesh"),
        ("layout_map", "--layout-map needs --mesh, whose device mesh it is given"),
    ):
        if getattr(args, option, None) and not args.mesh:
            return says
    return None


def virtual_devices(args: argparse.Namespace) -> None:
    """Plans run on virtual CPU devices: enough of them, set before JAX starts its backends."""
    if not getattr(args, "mesh", None):
        return
    flag = f"--xla_force_host_platform_device_count={math.prod(mesh_shape(args.mesh))}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


@contextlib.contextmanager
def distributed(args: argparse.Namespace) -> Iterator[None]:
    """The command runs under the distribution `--mesh` describes, if given; the caller's is put
    back after (`main` also runs inside other programs)."""
    if not getattr(args, "mesh", None):
        yield
        return
    import keras

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_distribution(args))
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


def _distribution(args: argparse.Namespace) -> Any:
    import jax
    from keras.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel

    shape = mesh_shape(args.mesh)
    axes = tuple(args.axes.split(",")) if args.axes else ("batch", "model")[: len(shape)]
    if len(shape) > 2 and not args.axes:
        raise ValueError(f"--axes must name the {len(shape)} axes of --mesh {args.mesh}")
    devices = jax.devices("cpu")
    if len(devices) < math.prod(shape):
        raise RuntimeError(
            f"--mesh {args.mesh} needs {math.prod(shape)} devices; JAX has {len(devices)} CPU devices "
            "(XLA_FLAGS was fixed before keras-orbax could set it)."
        )
    mesh = DeviceMesh(shape, axes, devices[: math.prod(shape)])
    if args.layout_map:
        layout_map = load_function(args.layout_map)(mesh)
    elif len(shape) == 1:
        return DataParallel(device_mesh=mesh)
    else:
        layout_map = LayoutMap(mesh)
    return ModelParallel(layout_map=layout_map, batch_dim_name=axes[0])
