"""Peak memory of a deferred restore, measured in a fresh process: one sharded copy of the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "workers" / "memory_restore.py"
ROOT = Path(__file__).parent.parent


def _run(mode: str, directory: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="1048576")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, str(WORKER), mode, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if not mode.startswith("save") else {}


def test_deferred_restore_peaks_at_one_copy_of_the_model(tmp_path):
    _run("save", tmp_path)
    figures = _run("restore", tmp_path)
    kernel_bytes, bias_bytes = (2048 * 4096 + 4096 * 2048) * 4, (4096 + 2048) * 4
    model_bytes = kernel_bytes + bias_bytes
    # Each kernel is split over the 8 devices, so its shards add up to one copy; the biases are
    # replicated, one copy per device, yet each is read from disk once.
    assert figures["resident"] == kernel_bytes + 8 * bias_bytes
    assert figures["bytes_read"] == model_bytes
    growth = figures["peak"] - figures["after_imports"]
    # A full copy of either kernel on one device, or a second copy of the model, would add >= 32 MiB.
    assert growth <= 1.15 * model_bytes, figures


def test_restore_onto_regions_that_cut_the_saved_rows_peaks_at_one_copy(tmp_path):
    _run("save", tmp_path)
    figures = _run("restore_cut", tmp_path)
    kernel_bytes, bias_bytes = (2048 * 4096 + 4096 * 2048) * 4, (4096 + 2048) * 4
    # Saved (2, 4), restored (1, 8): each target region takes half of every row of 4 saved shards,
    # read together with the other regions in pieces of 1 MiB (one buffer per reading thread).
    assert figures["resident"] == kernel_bytes + 8 * bias_bytes
    assert figures["bytes_read"] == kernel_bytes + bias_bytes
    growth = figures["peak"] - figures["after_imports"]
    assert growth <= 1.15 * (kernel_bytes + bias_bytes), figures


def test_deferred_load_of_a_keras_weights_file_peaks_at_one_copy(tmp_path):
    _run("save_h5", tmp_path)
    figures = _run("restore_h5", tmp_path)
    embedding, kernel, bias = 32768 * 512 * 4, 512 * 8 * 4, 8 * 4
    # The embedding and the kernel are split over the 8 devices; the bias is replicated on each.
    assert figures["resident"] == embedding + kernel + 8 * bias
    assert figures["bytes_read"] == embedding + kernel + bias
    growth = figures["peak"] - figures["after_imports"]
    # Keras's own path puts the whole 64 MiB embedding on one device before splitting it: two
    # copies at least. Read region by region from the file, the peak stays near one (measured
    # 1.26-1.30 x in repeated runs here, after a warm-up restore of a tiny model has set up the
    # runtime; the rest is the runtime's own allocations and the read window's last region).
    assert growth <= 1.5 * embedding, figures


def test_load_model_builds_the_optimizer_deferred_and_peaks_at_one_copy(tmp_path):
    _run("save_compiled", tmp_path)
    figures = _run("load_model", tmp_path)
    kernels, biases, counters = (2048 * 4096 + 4096 * 2048) * 4, (4096 + 2048) * 4, 2 * 4
    # The model and Adam's two slots of each variable: kernels split over the 8 devices, biases
    # and the optimizer's step counter and learning rate replicated on each.
    assert figures["resident"] == 3 * kernels + 8 * (3 * biases + counters)
    growth = figures["peak"] - figures["after_imports"]
    # Compiling from the stored config and building Adam's slots initialized (as Keras's
    # compile_from_config does) would add a second copy of the optimizer state: 2 x 64 MiB,
    # 1.6 x in all (measured 1.14 x here).
    assert growth <= 1.3 * figures["resident"], figures
