"""What the `keras-orbax` command line prints: results on stdout, a reader that stops early taken
quietly, and errors and warnings as one line on stderr, in the command line's own words.

Imports only the standard library and `keras_orbax.errors`: `--help` loads neither JAX, Keras nor
Orbax.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from keras_orbax import errors


def emit(text: str) -> None:
    """Prints `text` on stdout. A reader that stopped early (`| head -1`) is not an error: the rest
    of the output is dropped, quietly, and the command keeps its exit code."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        detach_stdout()


def detach_stdout() -> None:
    """Points stdout at /dev/null, so that Python's flush at exit finds no closed pipe (which it
    would report as `Exception ignored ... BrokenPipeError`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def error_line(args: argparse.Namespace, error: BaseException) -> str:
    """`keras-orbax COMMAND: error: ...`, one line, no traceback: every error of ours names its
    path; another library's is followed by the locations the command was given."""
    said = for_the_command_line(one_line(error))
    given = _locations(args)
    if given and not any(p in said for p in given):  # another library's error
        what = "location given" if len(given) == 1 else "locations given"
        said += f" ({what}: {', '.join(repr(p) for p in given)})"
    return f"keras-orbax {args.command}: error: {said}"


def _locations(args: argparse.Namespace) -> list[str]:
    """The locations the command was given, as given."""
    names = ("directory", "source", "destination", "a", "b")
    return [str(getattr(args, name)) for name in names if getattr(args, name, None)]


def show_warning(
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
    text = for_the_command_line(" ".join(str(message).split()))
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


def for_the_command_line(text: str) -> str:
    for python, command_line in _COMMAND_LINE_ADVICE:
        text = text.replace(python, command_line)
    return text


def one_line(error: BaseException) -> str:
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
