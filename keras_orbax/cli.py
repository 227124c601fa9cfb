"""The `keras-orbax` command line (also `python -m keras_orbax`).

    keras-orbax inspect SRC [--step N] [--json]
    keras-orbax diff A B [--values] [--json]          A, B: DIR, DIR@STEP, .weights.h5, .keras, ...
    keras-orbax plan SRC --model MODULE:FUNCTION [--step N] [--processes P]
                     [--mesh 2x4 [--axes batch,model] [--layout-map MODULE:FUNCTION]] [--json]
    keras-orbax convert SRC DST [--model MODULE:FUNCTION] [--step N] [--preset | --transformers]
                     [--mesh 2x4 [--axes batch,model] [--layout-map MODULE:FUNCTION]] [--json]
                     DST: DIR, x.weights.h5, PRESET_DIR (--preset), HF_DIR (--transformers)
    keras-orbax verify SRC [--step N] [--json]

Each subcommand is also a Python function (`inspect`, `diff`, `plan_restore_report`, `convert`,
`verify`). Every SRC is any location `restore_sharded` takes: DIR, DIR/STEP, DIR@STEP, a
`.weights.h5`, `.weights.json` or `.keras` file, a keras-hub preset or a Hugging Face directory.
Errors print one line, naming the path, and exit 2; `diff` exits 1 when the sources differ,
`verify` when something could not be checked against recorded checksums.
`--quiet` prints only errors. Progress (bytes and rate) shows on a terminal only. A reader that
stops early (`keras-orbax inspect DIR | head -1`) ends the output quietly, with the command's own
exit code.

Starting is cheap: this module imports only the standard library, and each subcommand imports what
it needs when it runs, so `--help` and a usage error load neither JAX, Keras nor Orbax.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from keras_orbax import errors

EXIT_DIFFERENT = 1
EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except BrokenPipeError:  # `--help | head -1`, with more help than a pipe holds
        _detach_stdout()
        return 0
    for option, says in (
        ("axes", "--axes names the axes of --mesh"),
        ("layout_map", "--layout-map needs --mesh, whose device mesh it is given"),
    ):
        if getattr(args, option, None) and not args.mesh:
            print(f"keras-orbax {args.command}: error: {says}", file=sys.stderr)
            return EXIT_ERROR
    if getattr(args, "mesh", None):
        _virtual_devices(math.prod(_mesh_shape(args.mesh)))
    # Libraries that log their own retries and tracebacks (absl's notices; gcsfs and s3fs on an
    # unreachable store: 200 lines before the one error that matters) say it in the error instead.
    quieted = {name: logging.getLogger(name) for name in _CHATTY_LOGGERS}
    levels = {name: logger.level for name, logger in quieted.items()}
    for name, logger in quieted.items():
        logger.setLevel(logging.ERROR if name == "absl" else logging.CRITICAL)
    # Restored on return: `main` also runs inside other programs (and tests), whose logging and
    # warning filters are theirs.
    with warnings.catch_warnings():
        if args.quiet:
            warnings.simplefilter("ignore")
        warnings.showwarning = functools.partial(_show_warning, args.command, warnings.showwarning)
        try:
            _prepare()
            with _distributed(args):
                return int(args.run(args) or 0)
        except KeyboardInterrupt:
            print("keras-orbax: interrupted", file=sys.stderr)
            return EXIT_ERROR
        except Exception as error:  # one line, no traceback: every error of ours names its path
            said = _for_the_command_line(_one_line(error))
            given = _locations(args)
            if given and not any(p in said for p in given):  # another library's error
                what = "location given" if len(given) == 1 else "locations given"
                said += f" ({what}: {', '.join(repr(p) for p in given)})"
            print(f"keras-orbax {args.command}: error: {said}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            for name, logger in quieted.items():
                logger.setLevel(levels[name])


_CHATTY_LOGGERS = ("absl", "gcsfs", "s3fs", "fsspec", "aiobotocore", "botocore", "google.auth")


def _locations(args: argparse.Namespace) -> list[str]:
    """The locations the command was given, as given."""
    names = ("directory", "source", "destination", "a", "b")
    return [str(getattr(args, name)) for name in names if getattr(args, name, None)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-orbax", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    commands = parser.add_subparsers(dest="command", required=True)
    source = (
        "DIR, DIR/STEP, DIR@STEP, .weights.h5, .weights.json, .keras, a preset or an HF directory"
    )
    step = "the step of a checkpoint directory (default: the latest committed one)"
    json_help = "print one JSON document"
    model_help = "MODULE:FUNCTION (or path/file.py:FUNCTION) building the model"

    show = commands.add_parser(
        "inspect", parents=[common], help="steps and variables of a checkpoint"
    )
    show.add_argument("directory", help=source)
    show.add_argument("--step", type=int, default=None, help=step)
    show.add_argument("--json", action="store_true", help=json_help)
    show.set_defaults(run=_inspect)

    compare = commands.add_parser(
        "diff", parents=[common], help="compare two checkpoints or weight files"
    )
    compare.add_argument("a", help=source)
    compare.add_argument("b", help="the same kinds as A")
    compare.add_argument("--values", action="store_true", help="also compare values")
    compare.add_argument("--json", action="store_true", help=json_help)
    compare.set_defaults(run=_diff)

    dry = commands.add_parser("plan", parents=[common], help="what restore_sharded would do")
    dry.add_argument("directory", help=source)
    dry.add_argument("--model", required=True, help=model_help)
    dry.add_argument("--step", type=int, default=None, help=step)
    _add_mesh_arguments(dry)
    dry.add_argument(
        "--processes", type=_positive, default=None, help="split the devices over P processes"
    )
    dry.add_argument("--json", action="store_true", help=json_help)
    dry.set_defaults(run=_plan)

    write = commands.add_parser(
        "convert",
        parents=[common],
        help="write a keras-orbax checkpoint, .weights.h5, preset or HF directory",
    )
    write.add_argument("source", help=source)
    write.add_argument(
        "destination",
        help="checkpoint directory to write (local, gs:// or s3://), or a local x.weights.h5",
    )
    write.add_argument(
        "--model", default=None, help=f"{model_help}, whose loader maps SRC onto its variables"
    )
    write.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step to write (default: SRC's step, with its epoch and metrics; else 0)",
    )
    write.add_argument(
        "--preset",
        action="store_true",
        help="write DST as a keras-hub preset directory (a DST ending in .weights.h5 is written "
        "as Keras's weights file without it)",
    )
    write.add_argument(
        "--transformers",
        action="store_true",
        help="write DST as a Hugging Face directory (safetensors), as keras-hub exports it",
    )
    _add_mesh_arguments(write)
    write.add_argument("--json", action="store_true", help=json_help)
    write.set_defaults(run=_convert)

    check = commands.add_parser(
        "verify", parents=[common], help="read saved state back and check its checksums"
    )
    check.add_argument("directory", help=source)
    check.add_argument("--step", type=int, default=None, help=step)
    check.add_argument("--json", action="store_true", help=json_help)
    check.set_defaults(run=_verify)
    return parser


def _add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """`--mesh`, `--axes`, `--layout-map`: the distribution a command restores a model under."""
    parser.add_argument(
        "--mesh",
        type=_mesh_argument,
        default=None,
        help="device mesh shape, e.g. 2x4 (virtual CPU devices)",
    )
    parser.add_argument("--axes", default=None, help="mesh axis names, e.g. batch,model")
    parser.add_argument(
        "--layout-map", default=None, help="MODULE:FUNCTION(device_mesh) -> LayoutMap"
    )


def _emit(text: str) -> None:
    """Prints `text` on stdout. A reader that stopped early (`| head -1`) is not an error: the rest
    of the output is dropped, quietly, and the command keeps its exit code."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _detach_stdout()


def _detach_stdout() -> None:
    """Points stdout at /dev/null, so that Python's flush at exit finds no closed pipe (which it
    would report as `Exception ignored ... BrokenPipeError`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _prepare() -> None:
    """Fails in one line unless Keras runs (or, once imported, will run) on JAX; sets the storage
    layers' environment.

    In a fresh process where `KERAS_BACKEND` is `jax` (`keras_orbax` sets it unless the user chose
    another) Keras is not imported here: only where it already is, or where the variable names
    another backend, to check what Keras chose.
    """
    if "keras" in sys.modules or os.environ.get("KERAS_BACKEND") != "jax":
        from keras_orbax import _require_jax_backend

        _require_jax_backend()
    from keras_orbax._src.storage import locations

    locations.configure_environment()  # as `keras_orbax`'s verbs do, before the storage layers run


def _inspect(args: argparse.Namespace) -> int:
    from keras_orbax._src.tools.inspect_checkpoint import inspect

    info = inspect(args.directory, args.step)
    if not args.quiet:
        _emit(json.dumps(info.to_json(), indent=1) if args.json else str(info))
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
        document = {**result.__dict__, "identical": result.identical}
        _emit(json.dumps(document) if args.json else str(result))
    return 0 if result.identical else EXIT_DIFFERENT


def _plan(args: argparse.Namespace) -> int:

    from keras_orbax._src.tools.plan_report import plan_restore_report

    model = _build_deferred(args.model)
    report = plan_restore_report(model, args.directory, args.step, processes=args.processes)
    if not args.quiet:
        _emit(json.dumps(report.to_json(), indent=1) if args.json else str(report))
    return 0 if not report.problems else EXIT_DIFFERENT


def _build_deferred(spec: str) -> Any:
    """The model `--model SPEC` builds, under `deferred_init()`: nothing allocated."""
    from keras_orbax._src.model.deferred import deferred_init

    build = _load_function(spec)
    try:
        with deferred_init():
            return build()
    except errors.NotDeferrableError:
        raise errors.NotDeferrableError(
            f"--model {spec} compiles the model with an optimizer it makes, which keras-orbax "
            "cannot do while it builds the model without allocating it (Keras makes an "
            "optimizer's step counter from a number). Make the optimizer outside the function, "
            "at module level, and compile with that object; or return the model uncompiled (its "
            "optimizer state is then left out)."
        ) from None


def _convert(args: argparse.Namespace) -> int:
    from keras_orbax._src.runtime.progress import Progress, human_bytes
    from keras_orbax._src.tools.convert import convert

    model = _build_deferred(args.model) if args.model else None
    progress: list[Progress] = []
    written = [0]

    def on_write(nbytes: int, total: int) -> None:
        if not progress:
            progress.append(Progress("convert", total, enabled=not args.quiet).__enter__())
        progress[0].advance(nbytes)
        written[0] += nbytes

    try:
        step_dir = convert(
            args.source,
            args.destination,
            model=model,
            step=args.step,
            on_write=on_write,
            preset=args.preset,
            transformers=args.transformers,
        )
    finally:
        if progress:
            progress[0].__exit__(None, None, None)
    if not args.quiet:
        if args.json:
            exported = args.preset or args.transformers or str(step_dir).endswith(".weights.h5")
            document: dict[str, Any] = {"path": str(step_dir), "bytes": written[0]}  # no step
            if not exported:
                step = int(step_dir.name)
                document = {"step_dir": str(step_dir), "step": step, "bytes": written[0]}
            _emit(json.dumps(document))
        else:
            _emit(f"wrote {step_dir} ({human_bytes(written[0])})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Exit 0 when every array matched a recorded checksum, 1 when something could not be checked
    (no checksums recorded); a damaged step raises `CorruptCheckpointError`, printed as one line."""
    from keras_orbax._src.tools.verify_step import verify

    result = verify(args.directory, step=args.step, verbose=0 if args.quiet else 1)
    if not args.quiet:
        if args.json:
            _emit(json.dumps({**dataclasses.asdict(result), "intact": result.intact}))
        else:
            _emit(str(result))
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
        raise argparse.ArgumentTypeError(f"must look like 2x4. Received: {text!r}")
    return shape


def _mesh_argument(text: str) -> str:
    """`--mesh`, checked as argparse parses it: a bad one is a usage error (exit 2)."""
    _mesh_shape(text)
    return text


def _positive(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more. Received: {text!r}")
    return number


def _virtual_devices(count: int) -> None:
    """Plans run on virtual CPU devices: enough of them, set before JAX starts its backends."""
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


@contextlib.contextmanager
def _distributed(args: argparse.Namespace) -> Iterator[None]:
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


def _show_warning(
    command: str,
    show: Callable[..., None],
    message: Warning | str,
    category: type[Warning],
    *args: Any,
    **kwargs: Any,
) -> None:
    """keras-orbax's warnings as one line on stderr, as its errors are (`keras-orbax convert:
    warning: ...`); other libraries' as `show` (Python's own) shows them."""
    if not issubclass(category, errors.KerasOrbaxWarning):
        show(message, category, *args, **kwargs)
        return
    text = _for_the_command_line(" ".join(str(message).split()))
    print(f"keras-orbax {command}: warning: {text}", file=sys.stderr)


# What the Python API's messages advise, said for the command line. No command changes a model of
# the user's (the restore's assurance would mislead), none takes `strict`, and `--model`'s
# function runs under `deferred_init()`, where only an optimizer made outside it can be compiled.
_COMMAND_LINE_ADVICE = (
    (" No variable was modified.", ""),
    (" If the model changed on purpose, pass strict=False to restore only what matches.", ""),
    (
        "compile the model with its optimizer before convert",
        "compile it in --model's function with an optimizer made outside the function (at "
        "module level)",
    ),
    (
        "Set a distribution before building and restoring the model: ModelParallel with a "
        "LayoutMap to shard its weights over the devices, or DataParallel to replicate them.",
        "Pass --mesh (e.g. --mesh 1x8) with --layout-map MODULE:FUNCTION to shard its weights "
        "over the devices, or a 1-D --mesh (e.g. --mesh 8) to replicate them.",
    ),
    ("(preset=True)", "(--preset)"),
    ("(transformers=True)", "(--transformers)"),
)


def _for_the_command_line(text: str) -> str:
    for python, command_line in _COMMAND_LINE_ADVICE:
        text = text.replace(python, command_line)
    return text


def _one_line(error: BaseException) -> str:
    """The lines of an error's message joined as sentences: after a line that ends a sentence or
    opens a list (`.`, `:`), a space; between items, `; `; before the sentence that closes a list
    ("No variable was modified."), a full stop."""
    text = ""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if not text:
            text = line
        elif text.endswith((".", ":", ";")):
            text += " " + line
        elif i == len(lines) - 1 and line[0].isupper() and line.endswith("."):
            text += ". " + line
        else:
            text += "; " + line
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
