"""The seed case's exports: the loaded 9B model written by each export route, against the durable
write floor of the same shards measured beside it (`seed_case.py --export`).

For each route, in alternating order (floor first in even rounds), with `os.sync()` untimed before
each: the floor (every distinct shard written to its own new file by 8 threads and fsynced,
`bench_model.write_all`) and the export into a new directory. Both are deleted before the next
route, so the disk holds at most the preset and two copies of the model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from functools import partial

ROUTES = ("save_to_preset", "save_weights", "export_to_transformers")


def _export(route: str, model, directory: str, window: int) -> None:
    import keras_orbax

    if route == "save_to_preset":
        keras_orbax.save_to_preset(model, directory, window_bytes=window)
    elif route == "save_weights":
        os.makedirs(directory)
        keras_orbax.save_weights(
            model, os.path.join(directory, "model.weights.h5"), window_bytes=window
        )
    else:
        keras_orbax.export_to_transformers(model, directory, window_bytes=window)


def export_routes(
    model, out_dir: str, window_mib: float, rounds: int = 1, routes: Sequence[str] = ROUTES
) -> list[dict]:
    """Each route's time against the floor's, in this process; one dict per route and round."""
    from benchmarks import bench_model as bm

    shards = [
        s.data for v in model.weights for s in v.value.addressable_shards if s.replica_id == 0
    ]
    window = int(window_mib * 2**20)
    scratch = os.path.join(out_dir, "exports")
    results = []
    for round_ in range(rounds):
        for route in routes:
            shutil.rmtree(scratch, ignore_errors=True)
            paths = {"floor": os.path.join(scratch, "floor"), "case": os.path.join(scratch, route)}
            peak: dict = {}

            def case(route=route, path=paths["case"], peak=peak) -> None:
                peak["growth"] = bm.peak_growth(partial(_export, route, model, path, window))

            writes = {"floor": partial(bm.write_all, shards, paths["floor"]), "case": case}
            order = ["case", "floor"] if round_ % 2 else ["floor", "case"]
            times = {}
            for name in order:
                os.sync()
                start = bm.clock()
                writes[name]()
                times[name] = bm.since(start)
            written = sum(
                os.path.getsize(os.path.join(root, f))
                for root, _, files in os.walk(paths["case"])
                for f in files
            )
            results.append(
                {
                    "route": route,
                    "round": round_,
                    "seconds": times["case"][0],
                    "cpu_s": times["case"][1],
                    "floor_s": times["floor"][0],
                    "ratio": times["case"][0] / times["floor"][0],
                    "written_gb": written / 1e9,
                    "peak_over_resident_mib": None
                    if peak["growth"] is None
                    else peak["growth"] / 2**20,
                    "window_mib": window_mib,
                }
            )
    shutil.rmtree(scratch, ignore_errors=True)
    return results


def markdown(results: list[dict]) -> str:
    """The exports' table."""
    lines = [
        "| route | export s | floor s (same process) | ratio | written GB | peak over resident MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        peak = (
            "n/a" if r["peak_over_resident_mib"] is None else f"{r['peak_over_resident_mib']:.0f}"
        )
        lines.append(
            f"| `{r['route']}` | {r['seconds']:.1f} | {r['floor_s']:.1f} | {r['ratio']:.2f} x"
            f" | {r['written_gb']:.2f} | {peak} |"
        )
    return "\n".join(lines)
