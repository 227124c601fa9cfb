"""Loading Keras's own weight files sharded: keras-orbax against Keras's `load_weights`, in one run.

For each model (the benchmark model of `bench_model.py` with Adam, and one dominated by a single large
embedding) and each case, a fresh process loads the weights and reports time and peak RSS growth over
the resident bytes of the loaded state:

    keras_h5        normal build + compile + optimizer build + `model.load_weights(x.weights.h5)`
    ko_h5           `deferred_init` build + `restore_sharded(x.weights.h5)`
    ko_json         the same from `save_weights(..., max_shard_size=...)` (`x.weights.json` + parts)
    ko_converted    `restore_sharded` of the same state converted once to a keras-orbax checkpoint
    read_floor      reading every byte of the h5 file into fresh memory (page cache warm)
    e2e_keras_h5 / e2e_ko_h5   from an empty process to a model that has predicted once

Usage: python benchmarks/h5_benchmark.py [--params-gib 1.0] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model as bm  # noqa: E402

MODELS = ("dense", "embedding")
CASES = ("keras_h5", "ko_h5", "ko_json", "ko_converted", "read_floor", "e2e_keras_h5", "e2e_ko_h5")


def _build(model_name: str, spec: bm.ModelSpec, deferred: bool = False):
    import keras

    import keras_orbax

    optimizer = keras.optimizers.Adam(1e-3)
    with keras_orbax.deferred_init() if deferred else _null():
        if model_name == "dense":
            model = bm.build_model(spec, optimizer=optimizer, build_optimizer=False)
        else:
            tokens = keras.Input((bm.SEQ_LEN,), dtype="int32")
            x = keras.layers.Embedding(spec.width * 16, spec.width, name="embed")(tokens)
            out = keras.layers.Dense(1, name="head")(x)
            model = keras.Model(tokens, out, name="embedding_bench")
    if model_name == "embedding":
        model.compile(optimizer=optimizer, loss="mse")
    return model


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def _paths(work: str, model_name: str) -> dict[str, str]:
    return {
        "h5": os.path.join(work, f"{model_name}.weights.h5"),
        "json": os.path.join(work, f"{model_name}.weights.json"),
        "ko": os.path.join(work, f"{model_name}_ko"),
    }


def prepare(model_name: str, spec: bm.ModelSpec, work: str) -> None:
    """Writes the h5, sharded json and converted keras-orbax files of one trained-looking model."""
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution(rules=_rules()))
    model = _build(model_name, spec)
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    for v in model.variables + model.optimizer.variables:  # random-looking values
        if v.dtype == "float32":
            v.assign(rng.standard_normal(v.shape, dtype="float32"))
    paths = _paths(work, model_name)
    model.save_weights(paths["h5"])
    model.save_weights(paths["json"], max_shard_size=0.25)
    keras_orbax.save(model, paths["ko"], step=1, overwrite=True)


def _rules() -> dict[str, tuple]:
    return {**bm.layout_rules(), "embed/embeddings": ("batch", "model")}


def run_case(case: str, model_name: str, spec: bm.ModelSpec, work: str) -> dict:
    """Runs in a fresh process: one case, one model; returns seconds and memory figures."""
    start_wall = time.perf_counter()
    import jax
    import keras

    import keras_orbax

    paths = _paths(work, model_name)
    if case == "read_floor":
        baseline = bm.rss_bytes()
        clock = bm.clock()
        with open(paths["h5"], "rb", buffering=0) as f:
            data = f.read()
        seconds = bm.since(clock)[0]
        return {"seconds": seconds, "growth": bm.peak_rss_bytes() - baseline, "resident": len(data)}
    keras.distribution.set_distribution(bm.make_distribution(rules=_rules()))
    jax.devices()
    baseline = bm.rss_bytes()
    clock = bm.clock()
    if case in ("keras_h5", "e2e_keras_h5"):
        model = _build(model_name, spec)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(paths["h5"])
    else:
        model = _build(model_name, spec, deferred=True)
        source = {"ko_json": paths["json"], "ko_converted": paths["ko"]}.get(case, paths["h5"])
        keras_orbax.restore_sharded(model, source)
    seconds = bm.since(clock)[0]
    if case.startswith("e2e"):
        x, _ = bm.sample_batch(spec)
        x = x % spec.width
        model.predict(x, verbose=0)
        seconds = time.perf_counter() - start_wall
    state = [v.value for v in bm.state_variables(model)]
    return {
        "seconds": seconds,
        "growth": bm.peak_rss_bytes() - baseline,
        "resident": bm.resident_bytes(state),
    }


def _child(case: str, model_name: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--model",
        model_name,
        "--params-gib",
        str(args.params_gib),
        "--work",
        args.work,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{case}/{model_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "h5"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None)
    parser.add_argument("--model", default="dense")
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args()
    bm.set_env()
    spec = bm.ModelSpec(params_gib=args.params_gib)
    if args.prepare:
        prepare(args.model, spec, args.work)
        return
    if args.child:
        print(json.dumps(run_case(args.child, args.model, spec, args.work)))
        return
    os.makedirs(args.work, exist_ok=True)
    results = {}
    for model_name in args.models:
        command = [sys.executable, __file__, "--prepare", "--model", model_name]
        command += ["--params-gib", str(args.params_gib), "--work", args.work]
        subprocess.run(command, check=True, capture_output=True)
        for case in args.cases:
            runs = [_child(case, model_name, args) for _ in range(args.repeats)]
            row = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "peak_over_resident": statistics.median(r["growth"] / r["resident"] for r in runs),
                "resident_gib": runs[0]["resident"] / 2**30,
            }
            results[f"{model_name}/{case}"] = row
            print(
                f"{model_name:<10} {case:<14} {row['seconds']:7.2f} s  "
                f"peak/resident {row['peak_over_resident']:.2f}  "
                f"(resident {row['resident_gib']:.2f} GiB)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
