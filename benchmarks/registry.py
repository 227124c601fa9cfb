"""Every benchmark of keras-orbax: its cases, its floor, its alternatives and its sizes.

Declared here, not in the benchmark modules, so that `python -m benchmarks --list` imports no
JAX. Each module named by `run_case` holds the code that runs in the measured processes.
"""

from __future__ import annotations

from benchmarks.harness import Benchmark

CPU_S = ("cpu_s", "CPU s", ".3f")
PEAK_X = ("peak_x", "peak growth / array", ".2f")
_RESTORE = {
    "ko_deferred": "`deferred_init` build, then `keras_orbax.restore_sharded` (model + Adam)",
    "ko_deferred_compact": 'ko_deferred from a `format="compact"` step (`--set compact=true`)',
    "ko_built": "normal build, then `keras_orbax.restore_sharded`",
    "keras_h5": 'build, then `model.load_weights("model.weights.h5")`',
    "keras_orbax_cb": "build, then `model.load_weights(<keras.callbacks.OrbaxCheckpoint dir>)`",
    "orbax_floor": "plain Orbax v1 `load` of the OrbaxCheckpoint callback's checkpoint",
    "orbax_floor_fast": "plain Orbax v1 `load` of the keras-orbax checkpoint's files",
    "disk_read": "every file of the keras-orbax checkpoint read into fresh buffers",
}
# Each case with glibc's default allocator and with `MALLOC_MMAP_THRESHOLD_=1048576`.
RESTORE = {**_RESTORE, **{f"{k}+mmap1M": f"{v}; `mmap1M` allocator" for k, v in _RESTORE.items()}}
INCREMENTAL = {
    f"{kind}_{saves}_{mode}": f"{kind}, {'incremental' if saves == 'inc' else 'full'} saves, {mode}"
    for kind in ("lora", "full")
    for mode in ("sync", "async")
    for saves in ("inc", "full")
}
INCREMENTAL["crc"] = "CRC-32C of `frozen_gib` GiB on one thread (the candidate test's cost)"
INCREMENTAL_FULL = {
    "model": "gemma", "frozen_gib": 1.0, "width": 2048, "rank": 8, "epochs": 6, "steps": 2,
    "batch": 8,
}  # fmt: skip
FIRST_SAVE = {
    "layers": 8, "width": 2048, "epochs": 4, "steps": 4, "devices": 8, "mesh": 1,
    "compile_first": 1, "settle": 0.0, "incremental": 1, "tf_site": "", "profile": "",
}  # fmt: skip
SPEED_LAYOUTS = ("cols", "rows", "2d", "2d_rows", "h5")
# speed_report's cases: component -> (benchmark, parameters over its sizes)
SPEED_COMPONENTS: dict[str, tuple[str, dict]] = {
    "save": ("save", {}),
    "save_many": ("save_many", {}),
    "many_restore": ("many_restore", {}),
    **{f"reshard_{layout}": ("reshard", {"layout": layout}) for layout in SPEED_LAYOUTS},
    "cold": ("cold", {}),
    "callback": ("callback", {}),
}
REPLICA = {
    f"{layout}_{cache}": f"{what}, page cache {cache}: `single_replica_reads=True` / `False`"
    for layout, what in (
        ("dp", "`DataParallel`"),
        ("replicated", 'kernels split over "model", replicated over "batch"'),
    )
    for cache in ("warm", "cold")
}
RESTORE_CASES = {
    "copied": "restore onto the saved layout, every byte read into fresh memory (the default)",
    "same": "restore onto the saved layout, large shards mapped (`KERAS_ORBAX_MAP_SHARDS=1`)",
    "other": "restore onto the other layout",
}


def _suite(
    name: str, module: str, summary: str, cases: dict, floor: str | None, prepare=True, **kw
) -> Benchmark:
    return Benchmark(
        name,
        summary,
        cases=cases,
        floor=floor,
        run_case=f"benchmarks.{module}:run_case",
        prepare=f"benchmarks.{module}:prepare" if prepare else None,
        **kw,
    )


def _script(name: str, script: str, summary: str) -> Benchmark:
    return Benchmark(name, summary, script=script)


def _component(name: str) -> str:
    bench, override = SPEED_COMPONENTS[name]
    return f"`python -m benchmarks {bench}`" + "".join(f" `{k}={v}`" for k, v in override.items())


BENCHMARKS = [
    _suite(
        "reshard",
        "reshard_benchmark",
        "restore onto another layout against the saved one (a 256 MiB embedding at full size)",
        RESTORE_CASES,
        "copied",
        sizes={
            "small": {"rows": 4096, "cols": 256, "layout": "cols"},
            "full": {"rows": 65536, "cols": 1024, "layout": "cols"},
        },
        columns=(CPU_S, PEAK_X),
        targets={"other": 1.5},
    ),
    _suite(
        "verify",
        "verify_benchmark",
        "restore with every byte checked (the default) against `verify=False` and the read floor",
        {
            "read_put": "the step's files read into fresh memory, 8 threads, + one `device_put`"
            " in the target layout",
            "checked": "`restore_sharded(...)`: every byte read checked against its CRC",
            "unchecked": "`restore_sharded(..., verify=False)`",
        },
        "read_put",
        sizes={
            "small": {"rows": 4096, "cols": 256, "layout": "same", "layers": 4, "width": 64},
            "full": {"rows": 65536, "cols": 1024, "layout": "same", "layers": 24, "width": 256},
        },
        repeats=7,
        columns=(CPU_S,),
        targets={"checked": 1.3, "unchecked": 1.3},
    ),
    _suite(
        "cold",
        "cold_benchmark",
        "restore from a cold page cache against reading the same files cold",
        {
            "read_cold": "every file of the step read cold, 8 threads",
            "ko_cold": "`deferred_init` + `restore_sharded`, cold",
            "touch": "first touch of as many bytes of fresh memory",
        },
        "read_cold",
        sizes={"small": {"params_gib": 0.02}, "full": {"params_gib": 0.5}},
        repeats=5,
        evict=("read_cold", "ko_cold", "touch"),
        apart=("touch",),  # the next process after it is slower on this virtual machine
        targets={"ko_cold": 1.2},
    ),
    _suite(
        "mapped",
        "mapped_benchmark",
        "restore by copying (the default) against mapping the shard files",
        {
            "copy_warm": "shards copied into fresh memory, page cache warm (the default)",
            "map_warm": "shards of 4 MiB and more mapped, page cache warm",
            "copy_cold": "shards copied, files evicted first",
            "map_cold": "shards mapped, files evicted first",
        },
        "copy_warm",
        sizes={"small": {"params_mib": 8, "layers": 3}, "full": {"params_mib": 384, "layers": 3}},
        repeats=5,
        evict=("copy_cold", "map_cold"),
        columns=(
            CPU_S,
            ("peak_growth_mib", "peak growth MiB", ".0f"),
            ("RssAnon_mib", "RssAnon after MiB", ".0f"),
            ("RssFile_mib", "RssFile after MiB", ".0f"),
        ),
    ),
    _suite(
        "many_restore",
        "many_restore_benchmark",
        "restore of 5000 small variables against reading the step's files and Keras's h5 load",
        {
            "read": "every file of the step read into fresh memory, 8 threads",
            "ko": "`deferred_init` + `restore_sharded`",
            "keras_h5": "Keras `load_weights(.weights.h5)` into a built model",
        },
        "read",
        sizes={"small": {"layers": 50, "width": 64}, "full": {"layers": 2500, "width": 64}},
        columns=(CPU_S,),
        targets={"ko": 1.2},
    ),
    _suite(
        "save",
        "save_benchmark",
        "sync save against the durable write floor (8 Dense(4096) + Adam: 1.5 GiB at full size)",
        {
            "ko": '`keras_orbax.save(..., format="fast")`',
            "ko_orbax": "the same files written by Orbax/tensorstore",
            "compact": '`keras_orbax.save(..., format="compact")`: zstd + OCDBT',
            "orbax_std": "`orbax.checkpoint.StandardCheckpointer().save`",
            "keras_h5": '`model.save_weights("*.weights.h5")`',
        },
        None,
        sizes={
            "small": {"layers": 2, "width": 256},
            "full": {"layers": 8, "width": 4096},
        },
        columns=(
            CPU_S,
            ("floor_s", "floor s (same process)", ".3f"),
            ("disk_gib", "on disk GiB", ".2f"),
        ),
        targets={"ko": 1.1},
    ),
    _suite(
        "save_many",
        "save_benchmark",
        "sync save of 5000 small variables against the durable write floor",
        {
            "ko": '`keras_orbax.save(..., format="fast")`',
            "ko_orbax": "the same files written by Orbax/tensorstore",
            "keras_h5": '`model.save_weights("*.weights.h5")`',
        },
        None,
        sizes={
            "small": {"layers": 50, "width": 64, "many": True},
            "full": {"layers": 2500, "width": 64, "many": True},
        },
        columns=(CPU_S, ("floor_s", "floor s (same process)", ".3f")),
        targets={"ko": 1.2},
    ),
    _suite(
        "h5",
        "h5_benchmark",
        "loading Keras's own weight files sharded, against Keras's `load_weights`",
        {
            "read_floor": "every byte of the h5 file read into fresh memory (page cache warm)",
            "keras_h5": "build + compile + optimizer build + `load_weights(x.weights.h5)`",
            "ko_h5": "`deferred_init` build + `restore_sharded(x.weights.h5)`",
            "ko_json": "the same from `save_weights(..., max_shard_size=...)` (json + parts)",
            "ko_converted": "`restore_sharded` of the state converted to a keras-orbax checkpoint",
            "e2e_keras_h5": "empty process to a Keras-loaded model that has predicted once",
            "e2e_ko_h5": "empty process to a keras-orbax-loaded model that has predicted once",
        },
        "read_floor",
        sizes={
            "small": {"params_gib": 0.01, "model": "dense"},
            "full": {"params_gib": 1.0, "model": "dense"},
        },
        columns=(("peak_x_resident", "peak growth / resident", ".2f"),),
    ),
    _suite(
        "cli_startup",
        "cli_startup",
        "CPU seconds of the command line in fresh processes (the figure is CPU, not wall, time)",
        {
            "python": "`python -c pass`",
            "help": "`keras-orbax --help`",
            "help_m": "`python -m keras_orbax --help`",
            "inspect": "`keras-orbax inspect` of a one-layer checkpoint",
        },
        "python",
        sizes={"small": {}, "full": {}},
        repeats=5,
        cpu_devices=None,
    ),
    _suite(
        "restore",
        "restore_benchmark",
        "restore time and peak memory against Keras's loaders and plain Orbax, two allocators",
        RESTORE,
        "orbax_floor",
        sizes={
            "small": {"params_gib": 0.02, "layers": 3, "compact": False},
            "full": {"params_gib": 1.0, "layers": 15, "compact": False},
        },
        env={f"{case}+mmap1M": {"MALLOC_MMAP_THRESHOLD_": "1048576"} for case in _RESTORE},
        requires={"ko_deferred_compact": "compact", "ko_deferred_compact+mmap1M": "compact"},
        columns=(
            ("restore_cpu_s", "CPU s", ".2f"),
            ("e2e_s", "end-to-end s", ".1f"),
            ("peak_gib", "peak - import GiB", ".2f"),
            ("x_resident", "x resident", ".2f"),
            ("ok", "ok", ".0f"),
        ),
        render="benchmarks.restore_benchmark:render",
    ),
    _suite(
        "speed_report",
        "speed_report",
        "every speed target in one run: the benchmarks below through the harness, each ratio "
        "beside its target",
        {name: _component(name) for name in SPEED_COMPONENTS},
        None,
        prepare=False,
        sizes={"small": {"size": "small"}, "full": {"size": "full", "rounds": None}},
        repeats=1,
        cpu_devices=None,  # each component's processes set their own
        render="benchmarks.speed_report:render_report",
    ),
    _script(
        "seed_case", "seed_case.py", "the seed's own case: a Gemma2 9B preset, load and export"
    ),
    _suite(
        "callback",
        "callback_benchmark",
        "time `fit` is blocked per save: mean over the saves of one `fit`, the first included",
        {
            "sync": "`keras_orbax.ModelCheckpoint(save_on_background=False)`",
            "async": "`keras_orbax.ModelCheckpoint()` (saves in the background, the default)",
            "keras": "`keras.callbacks.OrbaxCheckpoint()` (Keras 3.15)",
        },
        "sync",
        prepare=False,
        sizes={
            "small": {"mib": 16, "epochs": 2, "steps": 2},
            "full": {"mib": 256, "epochs": 4, "steps": 8},
        },
        repeats=1,
        columns=(
            ("max_s", "longest save s", ".3f"),
            ("on_train_end_s", "on_train_end s", ".2f"),
            ("fit_s", "fit s", ".2f"),
        ),
        targets={"async": 0.05},
    ),
    _suite(
        "local_tier",
        "local_tier_benchmark",
        "`fit` with a local tier (/dev/shm) against `fit` with the persistent tier alone",
        {
            "persistent": "`ModelCheckpoint(dir)`, a save at each epoch's end",
            "local": "the same with `local_directory=<shm>, local_save_freq=every` "
            "(`--set every=N`; 1 by default)",
            "copy": "the same, but each local save only writes the state's bytes into files "
            "already in /dev/shm, while `fit` waits (the floor of a local save)",
            "plain": "`fit` with no checkpoint",
        },
        "persistent",
        prepare=False,
        sizes={
            "small": {"mib": 16, "epochs": 1, "steps": 4},
            "full": {"mib": 256, "epochs": 2, "steps": 8},
        },
        repeats=3,
        columns=(
            ("step_ms", "step ms", ".1f"),
            ("blocked_ms", "blocked per save ms", ".1f"),
            ("blocked_max_ms", "longest ms", ".1f"),
        ),
        targets={"local": 1 / 0.9},
    ),
    _suite(
        "local_tier_processes",
        "local_tier_multiprocess_benchmark",
        "`fit` with a local tier saving after every batch under jax.distributed (2 processes x 4 "
        "CPU devices, each its own /dev/shm folder, its part sent to its peer) against `fit` alone",
        {
            "plain": "`fit` with no checkpoint",
            "local": "`ModelCheckpoint(dir, local_directory=<shm>/<process>, local_save_freq=1)`",
        },
        "plain",
        prepare=False,
        sizes={
            "small": {"mib": 16, "epochs": 1, "steps": 4},
            "full": {"mib": 256, "epochs": 2, "steps": 8},
        },
        repeats=3,
        cpu_devices=1,  # the case process starts the 2 workers, which set their own
        columns=(
            ("step_ms", "step ms", ".1f"),
            ("blocked_ms", "blocked per save ms", ".1f"),
            ("blocked_max_ms", "longest ms", ".1f"),
        ),
        targets={"local": 1 / 0.9},
    ),
    _suite(
        "local_recovery_processes",
        "local_tier_multiprocess_benchmark",
        "a resumed `fit`'s start to its first trained batch under jax.distributed (2 processes x 4 "
        "CPU devices), from each process's own part or from its peer's replica, against `fit` "
        "alone + reading and placing each process's part",
        {
            "floor": "`fit` to its first batch, then each process's part of the local step read "
            "into fresh memory and placed on its devices",
            "recover": "`ModelCheckpoint(..., local_directory=<shm>/<process>, resume=True)`",
            "recover_peer": "the same, process 1's local directory deleted first: its part "
            "comes from process 0's replica over the ring",
        },
        "floor",
        sizes={
            "small": {"mib": 16, "epochs": 1, "steps": 4},
            "full": {"mib": 256, "epochs": 1, "steps": 8},
        },
        repeats=3,
        cpu_devices=1,  # the case process starts the 2 workers, which set their own
        columns=(("first_batch_s", "fit to first batch s", ".2f"),),
        targets={"recover": 1.2},
    ),
    _suite(
        "local_recovery",
        "local_tier_benchmark",
        "a resumed `fit`'s start to its first trained batch, from the local tier, against `fit` "
        "alone + reading and placing the step's bytes",
        {
            "floor": "`fit` to its first batch, then the local step's files read into fresh "
            "memory (8 threads) and placed as the variables are",
            "recover": "`ModelCheckpoint(..., local_directory=<shm>, resume=True)`",
        },
        "floor",
        sizes={
            "small": {"mib": 16, "epochs": 1, "steps": 4},
            "full": {"mib": 256, "epochs": 1, "steps": 8},
        },
        repeats=3,
        columns=(("first_batch_s", "fit to first batch s", ".2f"),),
        targets={"recover": 1.2},
    ),
    _suite(
        "first_save",
        "first_save",
        "time `fit` is blocked by the first background save of a fresh process, x a sync save",
        {
            "without_tf": "first `ModelCheckpoint` save of the process, TensorFlow not importable",
            "with_tf": "the same with TensorFlow on the path (`--set tf_site=DIR`)",
        },
        None,
        prepare=False,
        sizes={
            "small": dict(FIRST_SAVE, layers=2, width=256, epochs=2, steps=2),
            "full": FIRST_SAVE,
        },
        requires={"with_tf": "tf_site"},
        cpu_devices=None,  # the process sets its own (`devices`)
        columns=(
            ("floor_s", "sync save s (same process)", ".3f"),
            ("first_cpu_s", "first CPU s", ".3f"),
            ("later_s", "later saves s", ".3f"),
            ("later_x_sync", "later x sync", ".3f"),
            ("on_train_begin_s", "on_train_begin s", ".3f"),
        ),
    ),
    _suite(
        "incremental",
        "incremental_benchmark",
        "incremental saves of LoRA and a full fine-tune: bytes written and time per save",
        INCREMENTAL,
        None,
        prepare=False,
        sizes={
            "small": dict(INCREMENTAL_FULL, model="dense", frozen_gib=0.01, width=256, epochs=3),
            "full": INCREMENTAL_FULL,
        },
        repeats=1,
        cpu_devices=1,
        columns=(
            ("floor_s", "changed-only save s", ".3f"),
            ("written_mib", "written MiB", ".1f"),
            ("changed_mib", "changed MiB", ".1f"),
            ("state_mib", "of MiB", ".1f"),
            ("restore_s", "restore s", ".3f"),
        ),
    ),
    _suite(
        "replica",
        "replica_benchmark",
        "single-replica reads over 4 processes x 2 CPU devices against each process reading its own",
        REPLICA,
        None,
        prepare=False,
        sizes={
            "small": {"mib": 16, "pairs": 1, "store": "file"},
            "full": {"mib": 128, "pairs": 3, "store": "file"},
        },
        cpu_devices=1,  # the case process saves; its 4 workers set their own
        columns=(
            ("read_x_step_on", "read / step, on", ".2f"),
            ("read_x_step_off", "read / step, off", ".2f"),
            ("read_max_mib_on", "most read by one process MiB, on", ".1f"),
        ),
    ),
    _suite(
        "gpu_memory",
        "gpu_memory",
        "per-device peak memory of a restore on accelerators, and its time against read + "
        "`device_put` (`--set cpu_devices=8` on CPU)",
        {
            "ko_deferred": "`deferred_init` build, then `keras_orbax.restore_sharded`",
            "keras_h5": 'build, then `model.load_weights("model.weights.h5")`',
        },
        None,
        sizes={
            "small": {"params_gib": 0.05, "layers": 15, "with_optimizer": False},
            "full": {"params_gib": 4.0, "layers": 15, "with_optimizer": False},
        },
        cpu_devices=None,  # the accelerator's devices
        columns=(
            ("peak_x_owned", "device peak / owned, max", ".2f"),
            ("host_peak_gib", "host peak growth GiB", ".2f"),
        ),
        render="benchmarks.gpu_memory:render",
    ),
    _suite(
        "stress_kill",
        "stress_kill",
        "many kill-and-resume trials of a `ModelCheckpoint` run, per kind of kill (seconds per trial)",
        {
            "time": "SIGKILL from outside, 0-3 s into `fit`",
            "delete": "the trainer killed inside a retention delete",
            "commit": "the trainer killed just before a commit rename",
            "write": "the trainer killed at a metadata write",
        },
        None,
        prepare=False,
        sizes={"small": {"trials": 1, "seed": 0}, "full": {"trials": 15, "seed": 0}},
        repeats=1,
        cpu_devices=None,  # the trainer sets its own
        columns=(("killed", "killed", ".0f"), ("steps_checked", "steps checked", ".0f")),
    ),
    _suite(
        "resume_position",
        "resume_position_benchmark",
        "a resumed fit to its first trained batch, against the batches trained before the stop",
        {
            "fresh": "a `fit` from scratch to its first trained batch",
            "early": "resumed after 5 % of the epoch",
            "middle": "resumed after 50 % of the epoch",
            "late": "resumed after 95 % of the epoch",
        },
        "fresh",
        prepare=False,
        sizes={
            "small": {"batches": 20, "cost_s": 0.02},
            "full": {"batches": 200, "cost_s": 0.02},
        },
        cpu_devices=1,
        columns=(("stopped_at", "stopped at batch", ".0f"), ("reads", "batches read", ".0f")),
    ),
    _suite(
        "breakdown",
        "breakdown",
        "where a 256 MiB restore and save spend their time, by sampling profiler (py-spy)",
        {
            "restore_same_noverify": "same layout, `verify=False`",
            "restore_same": "same layout, checked (default)",
            "restore_reshard_noverify": "resharded, `verify=False`",
            "restore_reshard": "resharded, checked (default)",
            "save": "sync save",
        },
        None,
        prepare=False,
        sizes={
            "small": {"rows": 4096, "cols": 256, "seconds": 2},
            "full": {"rows": 65536, "cols": 1024, "seconds": 10},
        },
        repeats=1,
        cpu_devices=None,  # the profiled process sets its own
        render="benchmarks.breakdown:render",
    ),
    _suite(
        "export",
        "export_benchmark",
        "the three exports of a sharded Gemma (2B widths, 2 layers: 0.54 GiB) against the "
        "durable write floor",
        {
            "save_to_preset": "`keras_orbax.save_to_preset(backbone, dir)`",
            "save_weights": '`keras_orbax.save_weights(backbone, "model.weights.h5")`',
            "export_to_transformers": "`keras_orbax.export_to_transformers(backbone, dir)`",
        },
        None,
        sizes={
            "small": {
                "vocabulary": 1024,
                "layers": 2,
                "heads": 4,
                "hidden": 256,
                "intermediate": 2048,
                "window_mib": 1,
            },
            "full": {
                "vocabulary": 32768,
                "layers": 2,
                "heads": 8,
                "hidden": 2048,
                "intermediate": 32768,
                "window_mib": 64,
            },
        },
        columns=(
            CPU_S,
            ("floor_s", "floor s (same process)", ".3f"),
            ("written_gib", "written GiB", ".3f"),
            ("peak_mib", "peak over resident MiB", ".1f"),
        ),
        targets={"save_to_preset": 1.2, "save_weights": 1.2, "export_to_transformers": 1.2},
    ),
]
BY_NAME = {b.name: b for b in BENCHMARKS}
