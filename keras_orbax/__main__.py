"""Command line: `python -m keras_orbax inspect DIRECTORY [--step N]`."""

from __future__ import annotations

import argparse
import sys

from keras_orbax._inspect import inspect
from keras_orbax.errors import KerasOrbaxError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keras_orbax")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("inspect", help="describe a checkpoint step from its metadata")
    show.add_argument("directory")
    show.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        print(inspect(args.directory, args.step))
    except KerasOrbaxError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
