"""The `keras-orbax` command line (also `python -m keras_orbax`).

    keras-orbax inspect SRC [--step N] [--json]
    keras-orbax diff A B [--values] [--json]          A, B: DIR, DIR@STEP, .weights.h5, .keras, ...
    keras-orbax plan SRC --model MODULE:FUNCTION [--step N] [--processes P]
                     [--mesh 2x4 [--axes batch,model] [--layout-map MODULE:FUNCTION]] [--json]
    keras-orbax convert SRC DST [--model MODULE:FUNCTION] [--step N] [--preset | --transformers]
                     [--mesh 2x4 [--axes batch,model] [--layout-map MODULE:FUNCTION]] [--json]
                     DST: DIR, x.weights.h5, PRESET_DIR (--preset), HF_DIR (--transformers)
    keras-orbax verify SRC [--step N] [--json]
    keras-orbax --version

Each subcommand is also a Python function (`inspect`, `diff`, `plan_restore_report`, `convert`,
`verify`). Every SRC is any location `restore_sharded` takes: DIR, DIR/STEP, DIR@STEP, a
`.weights.h5`, `.weights.json` or `.keras` file, a keras-hub preset or a Hugging Face directory.
Errors print one line, naming the path, and exit 2; `diff` exits 1 when the sources differ,
`verify` when something could not be checked against recorded checksums.
`--quiet` prints only errors. Progress (bytes and rate) shows on a terminal only. A reader that
stops early (`keras-orbax inspect DIR | head -1`) ends the output quietly, with the command's own
exit code.

Starting is cheap: this module and the `cli_*` modules of `keras_orbax._src.tools` it wires
(arguments, commands, mesh, user code, messages) import only the standard library, and each
subcommand imports what it needs when it runs, so `--help` and a usage error load neither JAX,
Keras nor Orbax.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import warnings

from keras_orbax._src.tools import cli_arguments, cli_commands, cli_mesh, cli_messages
from keras_orbax._src.tools.cli_commands import EXIT_DIFFERENT, EXIT_ERROR

__all__ = ["EXIT_DIFFERENT", "EXIT_ERROR", "main"]


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except BrokenPipeError:  # `--help | head -1`, with more help than a pipe holds
        cli_messages.detach_stdout()
        return 0
    says = cli_mesh.usage_error(args)
    if says:
        print(f"keras-orbax {args.command}: error: {says}", file=sys.stderr)
        return EXIT_ERROR
    cli_mesh.virtual_devices(args)
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
        warnings.showwarning = functools.partial(
            cli_messages.show_warning, args.command, warnings.showwarning
        )
        try:
            _prepare()
            with cli_mesh.distributed(args):
                return int(args.run(args) or 0)
        except KeyboardInterrupt:
            print("keras-orbax: interrupted", file=sys.stderr)
            return EXIT_ERROR
        except Exception as error:  # one line, no traceback: every error of ours names its path
            print(cli_messages.error_line(args, error), file=sys.stderr)
            return EXIT_ERROR
        finally:
            for name, logger in quieted.items():
                logger.setLevel(levels[name])


_CHATTY_LOGGERS = ("absl", "gcsfs", "s3fs", "fsspec", "aiobotocore", "botocore", "google.auth")

# Each verb: its help line, its arguments (cli_arguments), the function that runs it (cli_commands).
_VERBS = (
    (
        "inspect",
        "steps and variables of a checkpoint",
        cli_arguments.add_inspect_arguments,
        cli_commands.run_inspect,
    ),
    (
        "diff",
        "compare two checkpoints or weight files",
        cli_arguments.add_diff_arguments,
        cli_commands.run_diff,
    ),
    (
        "plan",
        "what restore_sharded would do",
        cli_arguments.add_plan_arguments,
        cli_commands.run_plan,
    ),
    (
        "convert",
        "write a keras-orbax checkpoint, .weights.h5, preset or HF directory",
        cli_arguments.add_convert_arguments,
        cli_commands.run_convert,
    ),
    (
        "verify",
        "read saved state back and check its checksums",
        cli_arguments.add_verify_arguments,
        cli_commands.run_verify,
    ),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-orbax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, help="show the versions and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, says, add_arguments, run in _VERBS:
        verb = commands.add_parser(name, parents=[common], help=says)
        add_arguments(verb)
        verb.set_defaults(run=run)
    return parser


class _Version(argparse.Action):
    """`--version`, on one line (argparse's own action wraps it at the terminal's width)."""

    def __init__(self, option_strings: list[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    """`keras-orbax 0.1.0 (keras 3.15.1, jax 0.10.2, ...)`: the installed versions of what it
    runs on, read from the packages' metadata (none of them is imported)."""
    from importlib import metadata

    from keras_orbax import __version__

    found = []
    for package in ("keras", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "keras-hub"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return f"keras-orbax {__version__} ({', '.join(found)})"


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


if __name__ == "__main__":
    sys.exit(main())
