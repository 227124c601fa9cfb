"""The seed case's exports: the loaded 9B model written by each export route, against the durable
write floor of the same shards measured beside it (`seed_case.py --export`).

For each route, in alternating order (floors first in even rounds), with `os.sync()` untimed
before each: the floor (every distinct shard written to its own new file by 8 threads and fsynced,
`bench_model.write_all`), the one-file floor (the same shards back to back in one new file, 8
threads, `bench_model.write_one_file`: what a format of one file pays, the filesystem serializing
writes to one inode) and the export into a new directory. Each is deleted once written, so the disk
holds at most the preset and one copy of the model.
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

            one_file = os.path.join(scratch, "one_file")
            writes = {
                "floor": partial(bm.write_all, shards, paths["floor"]),
                "one_file": partial(bm.write_one_file, shards, one_file),
                "case": case,
            }
            order = ["floor", "one_file", "case"]
            times, written = {}, 0
            for name in order[::-1] if round_ % 2 else order:
                os.sync()
                start = bm.clock()
                writes[name]()
                times[name] = bm.since(start)
                if name == "case":
                    written = sum(
                        os.path.getsize(os.path.join(root, f))
                        for root, _, files in os.walk(paths["case"])
                        for f in files
                    )
                if name == "one_file":
                    os.unlink(one_file)
                else:
                    shutil.rmtree(paths[name])
            results.append(
                {
                    "route": route,
                    "round": round_,
                    "seconds": times["case"][0],
                    "cpu_s": times["case"][1],
                    "floor_s": times["floor"][0],
                    "floor_cpu_s": times["floor"][1],
                    "ratio": times["case"][0] / times["floor"][0],
                    "one_file_s": times["one_file"][0],
                    "one_file_cpu_s": times["one_file"][1],
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
        "| route | export s | CPU s | floor s (same process) | CPU s | ratio | one-file floor s | CPU s"
        " | x that | written GB | peak over resident MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        peak = (
            "n/a" if r["peak_over_resident_mib"] is None else f"{r['peak_over_resident_mib']:.0f}"
        )
        one = r.get("one_file_s")
        one_file = (
            "- | - | -"
            if one is None
            else f"{one:.1f} | {r['one_file_cpu_s']:.1f} | {r['seconds'] / one:.2f} x"
        )
        lines.append(
            f"| `{r['route']}` | {r['seconds']:.1f} | {r['cpu_s']:.1f} | {r['floor_s']:.1f}"
            f" | {r.get('floor_cpu_s', float('nan')):.1f} | {r['ratio']:.2f} x | {one_file}"
            f" | {r['written_gb']:.2f} | {peak} |"
        )
    return "\n".join(lines)
