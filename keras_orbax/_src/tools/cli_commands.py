"""The `keras-orbax` verbs, one function each: runs the Python verb on the parsed arguments,
prints its result, returns the exit code. Each imports what it needs when it runs, so that
`--help` loads neither JAX, Keras nor Orbax."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from keras_orbax._src.tools.cli_messages import emit
from keras_orbax._src.tools.cli_user_code import build_deferred

EXIT_DIFFERENT = 1
EXIT_ERROR = 2


def run_inspect(args: argparse.Namespace) -> int:
    from keras_orbax._src.tools.inspect_checkpoint import inspect

    info = inspect(args.directory, args.step)
    if not args.quiet:
        emit(json.dumps(info.to_json(), indent=1) if args.json else str(info))
    return 0


def run_diff(args: argparse.Namespace) -> int:
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
        emit(json.dumps(document) if args.json else str(result))
    return 0 if result.identical else EXIT_DIFFERENT


def run_plan(args: argparse.Namespace) -> int:

    from keras_orbax._src.tools.plan_report import plan_restore_report

    model = build_deferred(args.model)
    report = plan_restore_report(model, args.directory, args.step, processes=args.processes)
    if not args.quiet:
        emit(json.dumps(report.to_json(), indent=1) if args.json else str(report))
    return 0 if not report.problems else EXIT_DIFFERENT


def run_convert(args: argparse.Namespace) -> int:
    from keras_orbax._src.runtime.progress import Progress, human_bytes
    from keras_orbax._src.tools.convert import convert

    model = build_deferred(args.model) if args.model else None
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
            emit(json.dumps(document))
        else:
            emit(f"wrote {step_dir} ({human_bytes(written[0])})")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every array matched a recorded checksum, 1 when something could not be checked
    (no checksums recorded); a damaged step raises `CorruptCheckpointError`, printed as one line."""
    from keras_orbax._src.tools.verify_step import verify

    result = verify(args.directory, step=args.step, verbose=0 if args.quiet else 1)
    if not args.quiet:
        if args.json:
            emit(json.dumps({**dataclasses.asdict(result), "intact": result.intact}))
        else:
            emit(str(result))
    return 0 if result.intact else EXIT_DIFFERENT
