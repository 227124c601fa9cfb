"""benchmarks/ as one suite: `python -m benchmarks --list` names every benchmark script, and a
benchmark runs through the harness (fresh processes, the floor in the same run, medians, the load
recorded) and renders a table. No figure is asserted: these are the suite's plumbing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import harness, render
from benchmarks.registry import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
# Modules of benchmarks/ that are the suite's own pieces or shared by benchmarks, not benchmarks.
SHARED = {
    "__init__",
    "__main__",
    "harness",
    "registry",
    "render",
    "bench_model",
    "_seed_render",
    "_seed_preset",
    "_seed_export",
    "hook_timer",
}


def _benchmark_modules() -> set[str]:
    return {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - SHARED


def test_list_names_every_benchmark_and_every_script_is_registered():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--list"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=True,
    )
    listed = {line.split()[0] for line in done.stdout.splitlines() if not line.startswith(" ")}
    assert listed == {b.name for b in BENCHMARKS}
    registered = {
        (b.script or "").removesuffix(".py") or b.run_case.split(":")[0].split(".")[-1]
        for b in BENCHMARKS
    }
    assert _benchmark_modules() <= registered, _benchmark_modules() - registered
    # Every benchmark is on the harness but the seed's own case.
    assert [b.name for b in BENCHMARKS if b.script] == ["seed_case"]
    for b in BENCHMARKS:
        assert b.script or (b.floor is None or b.floor in b.cases), b.name
        assert b.script or {"small", "full"} <= set(b.sizes), b.name


def test_a_benchmark_runs_through_the_harness_and_renders_a_table(tmp_path):
    # The cold benchmark's two cases that need no JAX, on three small files.
    for i in range(3):
        (tmp_path / f"shard_{i}").write_bytes(os.urandom(256 * 1024))
    bench = harness.Benchmark(
        "tiny",
        "three small files read and as much fresh memory touched",
        cases={"read_cold": "the files read cold", "touch": "fresh memory touched"},
        floor="read_cold",
        run_case="benchmarks.cold_benchmark:run_case",
        sizes={"small": {"params_gib": 0}},
        evict=("read_cold",),
        cpu_devices=None,
    )
    result = harness.measure(bench, "small", 2, str(tmp_path), log=lambda _: None)

    assert [list(r) for r in result["rounds"]] == [["read_cold", "touch"], ["touch", "read_cold"]]
    assert {r["read_cold"]["bytes"] for r in result["rounds"]} == {3 * 256 * 1024}
    summary = result["summary"]
    assert summary["read_cold"]["n"] == summary["touch"]["n"] == 2
    assert "x_floor" in summary["touch"] and "x_floor" not in summary["read_cold"]
    assert result["machine"]["cpus"] == os.cpu_count() and len(result["load_after"]) == 3

    text = render.write(bench, result, str(tmp_path / "out"), write_docs=False)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows] == ["`read_cold`", "`touch`"]
    assert rows[0].split("|")[5].strip() == "floor"
    assert (tmp_path / "out" / "tiny.md").read_text() == text


def test_only_runs_the_cases_named_and_the_floor(tmp_path):
    # `ko_cold` needs a saved step, absent here: run, it would fail the benchmark.
    (tmp_path / "shard").write_bytes(os.urandom(64 * 1024))
    bench = harness.Benchmark(
        "tiny",
        "one small file read and as much fresh memory touched",
        cases={"read_cold": "read", "ko_cold": "restore", "touch": "fresh memory"},
        floor="read_cold",
        run_case="benchmarks.cold_benchmark:run_case",
        sizes={"small": {"params_gib": 0}},
        cpu_devices=None,
    )
    params = {"params_gib": 0, "only": "touch"}
    result = harness.measure(bench, "small", 1, str(tmp_path), params=params, log=lambda _: None)

    assert list(result["rounds"][0]) == ["read_cold", "touch"]
    assert list(result["summary"]) == ["read_cold", "touch"]
    assert "x_floor" in result["summary"]["touch"]


def test_render_replaces_only_its_own_section():
    page = "# t\n\nkept\n<!-- bench:a:begin -->\nold\n<!-- bench:a:end -->\nafter\n"
    assert render.replace_section(page, "a", "new\n") == (
        "# t\n\nkept\n<!-- bench:a:begin -->\nnew\n<!-- bench:a:end -->\nafter\n"
    )
    assert render.replace_section("# t\n", "b", "x").endswith(
        "\n<!-- bench:b:begin -->\nx\n<!-- bench:b:end -->\n"
    )
