"""The arguments of each `keras-orbax` verb, with their help texts (`keras_orbax.cli` wires the
verbs to their commands)."""

from __future__ import annotations

import argparse

from keras_orbax._src.tools.cli_mesh import add_mesh_arguments

_SOURCE = "DIR, DIR/STEP, DIR@STEP, .weights.h5, .weights.json, .keras, a preset or an HF directory"
_STEP = "the step of a checkpoint directory (default: the latest committed one)"
_JSON = "print one JSON document"
_MODEL = "MODULE:FUNCTION (or path/file.py:FUNCTION) building the model"


def add_inspect_arguments(show: argparse.ArgumentParser) -> None:
    show.add_argument("directory", help=_SOURCE)
    show.add_argument("--step", type=int, default=None, help=_STEP)
    show.add_argument("--json", action="store_true", help=_JSON)


def add_diff_arguments(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("a", help=_SOURCE)
    compare.add_argument("b", help="the same kinds as A")
    compare.add_argument("--values", action="store_true", help="also compare values")
    compare.add_argument("--json", action="store_true", help=_JSON)


def add_plan_arguments(dry: argparse.ArgumentParser) -> None:
    dry.add_argument("directory", help=_SOURCE)
    dry.add_argument("--model", required=True, help=_MODEL)
    dry.add_argument("--step", type=int, default=None, help=_STEP)
    add_mesh_arguments(dry)
    dry.add_argument(
        "--processes", type=_positive, default=None, help="split the devices over P processes"
    )
    dry.add_argument("--json", action="store_true", help=_JSON)


def add_convert_arguments(write: argparse.ArgumentParser) -> None:
    write.add_argument("source", help=_SOURCE)
    write.add_argument(
        "destination",
        help="checkpoint directory to write (local, gs:// or s3://), or a local x.weights.h5",
    )
    write.add_argument(
        "--model", default=None, help=f"{_MODEL}, whose loader maps SRC onto its variables"
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
    add_mesh_arguments(write)
    write.add_argument("--json", action="store_true", help=_JSON)


def add_verify_arguments(check: argparse.ArgumentParser) -> None:
    check.add_argument("directory", help=_SOURCE)
    check.add_argument("--step", type=int, default=None, help=_STEP)
    check.add_argument("--json", action="store_true", help=_JSON)


def _positive(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more. Received: {text!r}")
    return number
