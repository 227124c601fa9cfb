"""The `keras-orbax` command line (also `python -m keras_orbax`).

    keras-orbax inspect DIR [--step N] [--json]
    keras-orbax diff A B [--values] [--json]          A, B: DIR, DIR@STEP, .weights.h5, .keras, ...
    keras-orbax plan DIR --model MODULE:FUNCTION [--mesh 2x4] [--axes batch,model]
                         [--layout-map MODULE:FUNCTION] [--processes P] [--step N] [--json]
    keras-orbax convert SRC DST [--model MODULE:FUNCTION] [--step N]
    keras-orbax verify SRC [--step N] [--json]

Each subcommand is also a Python function (`inspect`, `diff`, `plan_restore_report`, `convert`,
`verify`). Every SRC is any location `restore_sharded` takes: DIR, DIR/STEP, DIR@STEP, a
`.weights.h5`, `.weights.json` or `.keras` file, a keras-hub preset or a Hugging Face directory.
Errors print one line, naming the path, and exit 2; `diff` exits 1 when the sources differ,
`verify` when something could not be checked against recorded checksums.
`--quiet` prints only errors. Progress (bytes and rate) shows on a terminal only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_DIFFERENT = 1
EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    if getattr(args, "mesh", None):
        _virtual_devices(math.prod(_mesh_shape(args.mesh)))
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.quiet:
        warnings.simplefilter("ignore")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("keras-orbax: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except Exception as error:  # one line, no traceback: every error of ours names its path
        print(f"keras-orbax {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-orbax", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser(
        "inspect", parents=[common], help="steps and variables of a checkpoint"
    )
    show.add_argument("directory")
    show.add_argument("--step", type=int, default=None)
    show.add_argument("--json", action="store_true", help="print one JSON document")
    show.set_defaults(run=_inspect)

    compare = commands.add_parser(
        "diff", parents=[common], help="compare two checkpoints or weight files"
    )
    compare.add_argument("a", help="DIR, DIR@STEP, .weights.h5, .weights.json, .keras or a preset")
    compare.add_argument("b")
    compare.add_argument("--values", action="store_true", help="also compare values")
    compare.add_argument("--json", action="store_true")
    compare.set_defaults(run=_diff)

    dry = commands.add_parser("plan", parents=[common], help="what restore_sharded would do")
    dry.add_argument("directory")
    dry.add_argument("--model", required=True, help="MODULE:FUNCTION (or path/file.py:FUNCTION)")
    dry.add_argument("--step", type=int, default=None)
    dry.add_argument(
        "--mesh", default=None, help="device mesh shape, e.g. 2x4 (virtual CPU devices)"
    )
    dry.add_argument("--axes", default=None, help="mesh axis names, e.g. batch,model")
    dry.add_argument("--layout-map", default=None, help="MODULE:FUNCTION(device_mesh) -> LayoutMap")
    dry.add_argument(
        "--processes", type=int, default=None, help="split the devices over P processes"
    )
    dry.add_argument("--json", action="store_true")
    dry.set_defaults(run=_plan)

    write = commands.add_parser("convert", parents=[common], help="write a keras-orbax checkpoint")
    write.add_argument(
        "source", help="DIR, DIR@STEP, .weights.h5, .weights.json, .keras or a preset"
    )
    write.add_argument("destination")
    write.add_argument("--model", default=None, help="MODULE:FUNCTION building the architecture")
    write.add_argument("--step", type=int, default=0)
    write.set_defaults(run=_convert)

    check = commands.add_parser(
        "verify", parents=[common], help="read saved state back and check its checksums"
    )
    check.add_argument("directory")
    check.add_argument("--step", type=int, default=None)
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.set_defaults(run=_verify)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    from keras_orbax._src.tools.inspect_checkpoint import inspect

    info = inspect(args.directory, args.step)
    if not args.quiet:
        print(json.dumps(info.to_json(), indent=1) if args.json else info)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from keras_orbax._src.runtime.progress import Progress
    from keras_orbax._src.tools.diff import diff

    progress: list[Progress] = []

    def on_read(nbytes: int, total: int) -> None:
        if not progress:
            progress.append(Progress("diff", total, enabled=not args.quiet).__enter__())
        progress[0].advance(nbytes)

    try:
        result = diff(args.a, args.b, values=args.values, on_read=on_read)
    finally:
        if progress:
            progress[0].__exit__(None, None, None)
    if not args.quiet:
        print(
            json.dumps({**result.__dict__, "identical": result.identical}) if args.json else result
        )
    return 0 if result.identical else EXIT_DIFFERENT


def _plan(args: argparse.Namespace) -> int:
    import keras

    from keras_orbax._src.model.deferred import deferred_init
    from keras_orbax._src.tools.plan_report import plan_restore_report

    if args.mesh:
        keras.distribution.set_distribution(_distribution(args))
    build = _load_function(args.model)
    with deferred_init():
        model = build()
    report = plan_restore_report(model, args.directory, args.step, processes=args.processes)
    if not args.quiet:
        print(json.dumps(report.to_json(), indent=1) if args.json else report)
    return 0 if not report.problems else EXIT_DIFFERENT


def _convert(args: argparse.Namespace) -> int:
    from keras_orbax._src.model.deferred import deferred_init
    from keras_orbax._src.runtime.progress import Progress
    from keras_orbax._src.tools.convert import convert

    model = None
    if args.model:
        build = _load_function(args.model)
        with deferred_init():
            model = build()
    progress: list[Progress] = []

    def on_write(nbytes: int, total: int) -> None:
        if not progress:
            progress.append(Progress("convert", total, enabled=not args.quiet).__enter__())
        progress[0].advance(nbytes)

    try:
        step_dir = convert(
            args.source, args.destination, model=model, step=args.step, on_write=on_write
        )
    finally:
        if progress:
            progress[0].__exit__(None, None, None)
    if not args.quiet:
        print(f"wrote {step_dir}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Exit 0 when every array matched a recorded checksum, 1 when something could not be checked
    (no checksums recorded); a damaged step raises `CorruptCheckpointError`, printed as one line."""
    from keras_orbax import verify

    result = verify(args.directory, step=args.step, verbose=0 if args.quiet else 1)
    if not args.quiet:
        if args.json:
            print(json.dumps({**dataclasses.asdict(result), "intact": result.intact}))
        else:
            print(result)
    return 0 if result.intact else EXIT_DIFFERENT


def _load_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` (the user's own code, by choice)."""
    module_name, _, function = spec.rpartition(":")
    if not module_name or not function:
        raise ValueError(f"--model must be MODULE:FUNCTION. Received: {spec!r}")
    if module_name.endswith(".py"):
        location = Path(module_name)
        if not location.is_file():
            raise FileNotFoundError(f"No such file: '{location}' (from --model {spec})")
        loaded = importlib.util.spec_from_file_location(location.stem, location)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, function):
        raise AttributeError(f"'{module_name}' has no function '{function}' (from --model {spec})")
    return getattr(module, function)


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise SystemExit(f"keras-orbax: error: --mesh must look like 2x4. Received: {text!r}")
    return shape


def _virtual_devices(count: int) -> None:
    """Plans run on virtual CPU devices: enough of them, set before JAX starts its backends."""
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _distribution(args: argparse.Namespace) -> Any:
    import jax
    from keras.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel

    shape = _mesh_shape(args.mesh)
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
        layout_map = _load_function(args.layout_map)(mesh)
    elif len(shape) == 1:
        return DataParallel(device_mesh=mesh)
    else:
        layout_map = LayoutMap(mesh)
    return ModelParallel(layout_map=layout_map, batch_dim_name=axes[0])


def _one_line(error: BaseException) -> str:
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
