"""The seed's own case: a Gemma2 9B keras-hub preset loaded sharded on 8 CPU devices, against a cold
read of its files and against keras-hub's own `from_preset`, each in a fresh process.

    make     the preset (`gemma2_9b_en`'s configuration, pseudo-random bfloat16 weights) in the
             files keras-hub's `save_to_preset` writes, never holding the model (`_seed_preset.py`)
    read     every byte of the preset's files read once, 16 MiB at a time by 8 threads, the page
             cache dropped first (the floor)
    ko       `keras_orbax.from_preset(GemmaBackbone, preset, dtype="bfloat16")` under
             `ModelParallel` with keras-hub's `GemmaBackbone.get_layout_map(mesh)`, page cache
             dropped first; then a forward pass
    build    the same model built deferred with no weight read: what `ko` spends building it
    hub      keras-hub's own `GemmaBackbone.from_preset(preset, dtype="bfloat16")` under the same
             distribution; then the same forward pass, if it got that far
    export   (`--export`) the model loaded as in `ko`, then each export route against the durable
             write floor of its shards, in the same process (`_seed_export.py`)

The parent imports no JAX: it runs each case in a child and polls the child's `VmHWM` (the
kernel's peak RSS, exact between polls) and the machine's `MemAvailable`; a child that would take
the machine's last `--reserve-gib` is killed by the parent before the kernel's OOM killer picks a
process (on a shared machine, maybe another one) and is recorded as killed for memory, with the
peak it had reached.

Usage:
    python benchmarks/seed_case.py [--config small|medium|2b|9b] [--dir DIR]
        [--skip-make | --make-only] [--meshes 1x8 2x4] [--repeats 1] [--no-hub] [--json PATH]
        [--limit-gib G] [--reserve-gib G] [--write-docs]
    python benchmarks/seed_case.py --render RUN.json [--write-docs]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
GIB = 2**30
TARGETS = {"time": 1.15, "peak": 1.05}  # issue 27: x the cold read, x the resident bytes


def status_kib(pid: int | str, field: str) -> int | None:
    """A `VmHWM`-style field of /proc/<pid>/status in KiB (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    if field == "VmHWM" and pid == "self":
        # Sandboxed kernels (gVisor, as on the accelerator machines) keep no VmHWM.
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return None


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def cpu_seconds() -> float:
    """This process's CPU time so far, user and system, all threads."""
    times = os.times()
    return times.user + times.system


def preset_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, name) for name in os.listdir(directory))


# ---------------------------------------------------------------- children (fresh processes)


def child(case: str, args: argparse.Namespace) -> dict:
    if case == "make":
        import _seed_preset as sp

        # Made beside, then renamed: an interrupted make leaves no preset for --skip-make to take.
        partial = args.dir.rstrip("/") + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        made = sp.make(partial, sp.CONFIGS[args.config], max_shard_size=args.max_shard_size)
        if os.path.exists(os.path.join(args.dir, "config.json")):
            shutil.rmtree(args.dir)  # an earlier preset, made again
        os.rename(partial, args.dir)
        return made
    if case == "place":
        return place_files(preset_files(args.dir))
    if case in ("read", "read_kept"):
        clock, cpu = time.perf_counter(), cpu_seconds()
        nbytes = read_files(preset_files(args.dir), keep=case == "read_kept")
        return {
            "seconds": time.perf_counter() - clock,
            "cpu_s": cpu_seconds() - cpu,
            "bytes": nbytes,
        }
    return load_case(case, args)


_HUGE = 2**21  # a transparent huge page


def read_files(
    paths: list[str], threads: int = 8, piece: int = 16 * 2**20, keep: bool = False
) -> int:
    """Every byte of the files read once, in `piece`-sized reads by `threads` threads into a
    buffer each thread reuses: the disk's pace for these files, without holding them (the 9B's
    first part is 10 GiB). With `keep`, each piece goes into new memory that is kept, as a load
    must (the pages of every buffer are zeroed by the kernel when first touched), 2 MiB-aligned
    and advised `MADV_HUGEPAGE` (the issue's floor; keras-orbax's read buffers are advised so)."""
    kept: list[mmap.mmap] = []
    fds, pieces = _pieces(paths, piece)
    local = threading.local()

    def read(job: tuple[int, int, int]) -> int:
        fd, offset, length = job
        if keep:
            buffer = mmap.mmap(-1, length + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buffer.madvise(mmap.MADV_HUGEPAGE)
            kept.append(buffer)  # list.append is atomic
            start = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % _HUGE
            return os.preadv(fd, [memoryview(buffer)[start : start + length]], offset)
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(piece)
        return os.preadv(fd, [memoryview(local.buffer)[:length]], offset)

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(read, pieces))
    finally:
        for fd in fds.values():
            os.close(fd)


def _pieces(paths: list[str], piece: int) -> tuple[dict[str, int], list[tuple[int, int, int]]]:
    """Each file opened, and its (fd, offset, length) pieces of at most `piece` bytes."""
    fds = {path: os.open(path, os.O_RDONLY) for path in paths}
    pieces = [
        (fds[path], offset, min(piece, size - offset))
        for path in paths
        for size in [os.path.getsize(path)]
        for offset in range(0, size, piece)
    ]
    return fds, pieces


def load_case(case: str, args: argparse.Namespace) -> dict:
    import jax
    import keras
    import keras_hub
    import numpy as np

    import keras_orbax

    jax.devices()  # the CPU client and its 8 devices exist before the baseline is read
    # keras-orbax imports its restore path on first use (0.8 s here): imported before the clock,
    # like keras-hub, so that `load s` is building and reading.
    assert keras_orbax.from_preset and keras_orbax.restore_sharded
    out: dict = {"rss_import": status_kib("self", "VmRSS") * 1024}
    stage(args, case, "loading", out)
    cls = keras_hub.models.GemmaBackbone
    if args.mesh != "1":  # "1": one device (an accelerator chip), no distribution
        shape = tuple(int(n) for n in args.mesh.split("x"))
        mesh = keras.distribution.DeviceMesh(
            shape, ("batch", "model"), keras.distribution.list_devices()
        )
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=cls.get_layout_map(mesh), batch_dim_name="batch"
            )
        )
    clock, cpu = time.perf_counter(), cpu_seconds()
    if case == "build":  # what the load spends building the model: no weight read
        with keras_orbax.deferred_init():
            cls.from_preset(args.dir, load_weights=False, dtype=args.dtype)
        out["build_s"] = time.perf_counter() - clock
        return out
    if case in ("ko", "export"):
        model = keras_orbax.from_preset(cls, args.dir, dtype=args.dtype)
    else:
        model = cls.from_preset(args.dir, dtype=args.dtype)
    jax.block_until_ready([v.value for v in model.variables])
    out["load_s"] = time.perf_counter() - clock
    out["load_cpu_s"] = cpu_seconds() - cpu
    out["peak_load"] = status_kib("self", "VmHWM") * 1024
    out["rss_loaded"] = status_kib("self", "VmRSS") * 1024
    out.update(model_bytes(model))
    out.update(device_memory())
    if case == "export":
        import _seed_export

        stage(args, case, "exporting", out)
        out["exports"] = _seed_export.export_routes(
            model, args.out_dir, args.window_mib, args.export_rounds, args.export_routes
        )
        return out
    stage(args, case, "forward pass", out)
    tokens = np.random.default_rng(0).integers(0, model.vocabulary_size, (2, 8), dtype=np.int32)
    clock = time.perf_counter()
    # Called eagerly, op by op: `predict` compiles the whole backbone into one XLA program whose
    # temporaries (bfloat16 weights converted for the CPU's dots, gathered shards) outlived their
    # layer: +2 GiB or more for the 1.8 GB `medium` preset, against +0.3 GiB called eagerly.
    hidden = model({"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, training=False)
    out["forward_s"] = time.perf_counter() - clock
    hidden = np.asarray(hidden, np.float32)
    out["finite"] = bool(np.isfinite(hidden).all())
    out["output_shape"] = list(hidden.shape)
    np.save(os.path.join(args.out_dir, f"{case}_{args.mesh}.npy"), hidden)
    out["peak_end"] = status_kib("self", "VmHWM") * 1024
    return out


def device_memory() -> dict:
    """The first device's peak and current bytes since the process started, where the backend
    keeps them (accelerators; not CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    names = {"peak_bytes_in_use": "device_peak", "bytes_in_use": "device_in_use"}
    return {ours: stats[theirs] for theirs, ours in names.items() if theirs in stats}


def place_files(paths: list[str], threads: int = 8, piece: int = 64 * 2**20) -> dict:
    """The accelerator's floor: every byte of the files read in `piece`-sized reads by
    `threads` threads, each piece put on the first device as soon as it is read and kept there;
    and the host-to-device rate of one 1 GiB array already in memory."""
    import jax
    import numpy as np

    device = jax.devices()[0]
    fds, pieces = _pieces(paths, piece)

    def read_and_place(job: tuple[int, int, int]):
        fd, offset, length = job
        buffer = np.empty(length, np.uint8)
        os.preadv(fd, [memoryview(buffer)], offset)
        return jax.block_until_ready(jax.device_put(buffer, device))

    try:
        clock = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            placed = list(pool.map(read_and_place, pieces))
        seconds = time.perf_counter() - clock
    finally:
        for fd in fds.values():
            os.close(fd)
    nbytes = sum(p.nbytes for p in placed)
    del placed
    one = np.ones(GIB, np.uint8)
    jax.block_until_ready(jax.device_put(one[: 2**20], device))  # the transfer path warmed
    clock = time.perf_counter()
    jax.block_until_ready(jax.device_put(one, device))
    rate = GIB / (time.perf_counter() - clock)
    return {"seconds": seconds, "bytes": nbytes, "h2d_s": nbytes / rate, "h2d_gib_s": rate / GIB}


def stage(args: argparse.Namespace, case: str, name: str, out: dict) -> None:
    """Where the case is, for the parent to read if the case is killed."""
    with open(progress_path(args.out_dir, case, args.mesh), "w") as f:
        json.dump({"stage": name, **out}, f)


def progress_path(out_dir: str, case: str, mesh: str) -> str:
    return os.path.join(out_dir, f"{case}_{mesh}.progress.json")


def model_bytes(model) -> dict:
    """The model's bytes: logical (each variable once), on the devices (replicas counted) and in
    distinct host buffers (on CPU, devices holding the same shard can share one)."""
    logical = devices = distinct = 0
    seen = set()
    for v in model.variables:
        value = v.value
        logical += value.nbytes
        for shard in value.addressable_shards:
            devices += shard.data.nbytes
            pointer = shard.data.unsafe_buffer_pointer()
            if pointer not in seen:
                seen.add(pointer)
                distinct += shard.data.nbytes
    return {"logical_bytes": logical, "device_bytes": devices, "resident_bytes": distinct}


# ---------------------------------------------------------------- parent


def run_child(case: str, args: argparse.Namespace, mesh: str = "", env: dict | None = None) -> dict:
    """Runs one case in a fresh process, polling its peak RSS and the machine's free memory."""
    command = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--config",
        args.config,
        "--dir",
        args.dir,
    ]
    command += ["--out-dir", args.out_dir, "--max-shard-size", str(args.max_shard_size)]
    command += ["--dtype", args.dtype, "--platform", args.platform]
    if mesh:
        command += ["--mesh", mesh]
    if case == "export":
        command += ["--window-mib", str(args.window_mib)]
        command += ["--export-rounds", str(args.export_rounds)]
        command += ["--export-routes", *args.export_routes]
    reserve = int(args.reserve_gib * GIB)
    limit = int(args.limit_gib * GIB) if args.limit_gib else None
    progress = progress_path(args.out_dir, case, mesh)
    if os.path.exists(progress):
        os.remove(progress)
    clock = time.perf_counter()
    # Output to files, not pipes: a pipe nobody reads while polling would stall a talkative child.
    logs = [os.path.join(args.out_dir, f"{case}_{mesh or 'all'}.{n}") for n in ("out", "err")]
    with open(logs[0], "w") as out, open(logs[1], "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    peak = 0
    lowest_available = mem_available_bytes()
    killed_by_us = False
    while process.poll() is None:
        peak = max(peak, (status_kib(process.pid, "VmHWM") or 0) * 1024)
        available = mem_available_bytes()
        lowest_available = min(lowest_available, available)
        rss = (status_kib(process.pid, "VmRSS") or 0) * 1024
        if (available < reserve or (limit and rss > limit)) and not killed_by_us:
            peak = max(peak, (status_kib(process.pid, "VmHWM") or 0) * 1024)
            process.send_signal(signal.SIGKILL)
            killed_by_us = True
        time.sleep(0.1)
    process.wait()
    stdout, stderr = (Path(path).read_text() for path in logs)
    result: dict = {"case": case, "mesh": mesh, "wall_s": time.perf_counter() - clock}
    result.update(
        peak_polled=peak, lowest_available=lowest_available, returncode=process.returncode
    )
    answer = _answer(stdout)
    if process.returncode != 0 and os.path.exists(progress) and answer is None:
        with open(progress) as f:
            result.update(json.load(f))  # how far it got, and its RSS after the imports
    where = f" while {result['stage']}" if "stage" in result else ""
    if killed_by_us:
        why = (
            f"over {args.limit_gib} GiB"
            if limit and peak > limit
            else f"under {args.reserve_gib} GiB left"
        )
        result["outcome"] = f"killed for memory{where} at {peak / GIB:.1f} GiB ({why})"
    elif process.returncode == -signal.SIGKILL:
        result["outcome"] = (
            f"killed (SIGKILL: the kernel's OOM killer?){where} at {peak / GIB:.1f} GiB or more"
        )
    elif answer is None:
        result["outcome"] = f"failed (exit {process.returncode}): " + error_line(stderr)
        result["stderr_tail"] = stderr[-4000:]
    else:
        result["outcome"] = "ok"
        result.update(answer)
        if process.returncode != 0:  # seen once: an abort in XLA's teardown, after the answer
            result["exit_after_answer"] = f"exit {process.returncode}: " + error_line(stderr)
    print(f"  {case} {mesh}: {result['outcome']}, {result['wall_s']:.1f} s", file=sys.stderr)
    return result


def _answer(stdout: str) -> dict | None:
    """The child's JSON line, if it printed one."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def error_line(stderr: str) -> str:
    """The exception's own line of a traceback (its message's first line), else the last line."""
    lines = stderr.strip().splitlines() or ["(no output)"]
    raised = [
        line
        for line in lines
        if line and not line[0].isspace() and ("Error" in line or line.startswith("F0"))
    ]
    return (raised or lines)[-1][-300:]


def evict(directory: str) -> None:
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    from tests._page_cache import evict as evict_files

    os.sync()
    evict_files(preset_files(directory))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = "jax"
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    if args.render:
        import _seed_render as render

        with open(args.render) as f:
            report = json.load(f)
        report["summary"] = render.summarize(report, args.out_dir)  # by this renderer's rules
        text = render.markdown(report)
        print(text)
        if args.write_docs:
            render.write_docs(report, text)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    started = time.time()
    report: dict = {"config": args.config, "dir": args.dir, "machine": machine(), "runs": []}
    report["load_before"] = os.getloadavg()
    if not (args.skip_make and os.path.exists(os.path.join(args.dir, "config.json"))):
        report["make"] = run_child("make", args)
        if report["make"]["outcome"] != "ok":
            raise SystemExit(f"make failed: {report['make']['outcome']}")
        print(f"made {args.dir} in {report['make']['seconds']:.0f} s", file=sys.stderr)
    if args.make_only:
        return
    report["preset_bytes"] = sum(os.path.getsize(p) for p in preset_files(args.dir))
    report["preset_files"] = [os.path.basename(p) for p in preset_files(args.dir)]
    for mesh in args.meshes:
        for _ in range(args.repeats):
            cases = ("read", "read_kept", "ko") if args.kept_read else ("read", "ko")
            cases = ("read", "place", "ko") if args.platform == "accelerator" else cases
            for case in cases:  # alternating, each right after the other
                evict(args.dir)
                report["runs"].append(run_child(case, args, mesh))
    for mesh in args.meshes:
        report["runs"].append(run_child("build", args, mesh))
    if not args.no_hub:
        for mesh in args.meshes:
            evict(args.dir)
            report["runs"].append(run_child("hub", args, mesh))
    if args.export:
        import _seed_export

        report["export"] = run_child("export", args, args.export_mesh)
        print(_seed_export.markdown(report["export"].get("exports", [])), file=sys.stderr)
    report["load_after"] = os.getloadavg()
    report["minutes"] = (time.time() - started) / 60
    import _seed_render as render

    report["summary"] = render.summarize(report, args.out_dir)
    text = render.markdown(report)
    print(text)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    if args.write_docs:
        render.write_docs(report, text)


def machine() -> dict:
    import platform
    import subprocess as sp
    from importlib.metadata import version

    pkgs = ("keras", "keras-hub", "jax", "orbax-checkpoint", "numpy", "h5py")
    commit = sp.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB, 1),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in pkgs},
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _seed_configs() -> list[str]:
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import _seed_preset  # imports no JAX

    return list(_seed_preset.CONFIGS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(_seed_configs()), default="9b")
    p.add_argument(
        "--platform",
        choices=("cpu", "accelerator"),
        default="cpu",
        help="cpu: 8 virtual CPU devices; accelerator: JAX's own devices (--meshes 1: one chip)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="the preset's directory (default benchmarks/_work/seed_<config>)",
    )
    p.add_argument(
        "--skip-make", action="store_true", help="use the preset in --dir if it is there"
    )
    p.add_argument("--make-only", action="store_true", help="make the preset, measure nothing")
    p.add_argument("--meshes", nargs="*", default=["1x8", "2x4"], help="none: only --export")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per mesh (cold read, read into kept memory, load)",
    )
    p.add_argument("--no-hub", action="store_true", help="skip keras-hub's own from_preset")
    p.add_argument(
        "--export",
        action="store_true",
        help="also the three exports of the loaded model against the durable write floor",
    )
    p.add_argument("--export-mesh", default="2x4")
    p.add_argument("--export-rounds", type=int, default=1)
    routes = ["save_to_preset", "save_weights", "export_to_transformers"]  # _seed_export.ROUTES
    p.add_argument("--export-routes", nargs="+", choices=routes, default=routes)
    p.add_argument("--window-mib", type=float, default=256, help="the exports' window")
    p.add_argument(
        "--no-kept-read",
        dest="kept_read",
        action="store_false",
        help="skip the second reference: every byte read cold into new memory that is kept",
    )
    p.add_argument(
        "--reserve-gib", type=float, default=1.5, help="kill a case leaving less free memory"
    )
    p.add_argument(
        "--limit-gib", type=float, default=None, help="kill a case whose RSS passes this"
    )
    # keras-hub's `from_preset` casts float weights to Keras's default policy (float32) unless
    # given a dtype: the 9B in float32 would be 37 GB. Both loads get the preset's own.
    p.add_argument("--dtype", default="bfloat16", help="given to both from_preset calls")
    p.add_argument("--max-shard-size", type=float, default=10, help="GB, as in save_to_preset")
    p.add_argument("--json", default=None, help="default: <out-dir>/seed_case.json")
    p.add_argument("--out-dir", default=None, help="outputs of the cases (default: next to --dir)")
    p.add_argument("--write-docs", action="store_true", help="its section of the log + plot")
    p.add_argument("--render", default=None, help="only render this JSON of an earlier run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mesh", default="1x8", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dir = os.path.abspath(args.dir or os.path.join(HERE, "_work", f"seed_{args.config}"))
    args.out_dir = os.path.abspath(args.out_dir or args.dir.rstrip("/") + "_out")
    args.json = args.json or os.path.join(args.out_dir, "seed_case.json")
    return args


if __name__ == "__main__":
    main()
