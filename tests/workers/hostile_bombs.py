"""Runs each (bomb, verb) of argv[1] (JSON: [name, verb, location, architecture]) in this process
and prints, as JSON, for each: the error it raised (`module.Class`) and how far the peak RSS rose
above the RSS before it (`tests/_rss.py`). A fresh process: the peak is this run's alone."""

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import keras_orbax
from tests import _hostile
from tests._rss import peak_growth

# The verbs' modules load on first use: loaded now, so that what is measured is the verb's.
for _name in keras_orbax.__all__:
    getattr(keras_orbax, _name)


def _run(
    verb: str, hostile: _hostile.Hostile, destination: Path, model: Any, raised: list[str]
) -> None:
    try:
        _hostile.run_verb(verb, hostile, destination, model)
    except Exception as error:  # reported, with its type, to the test
        raised.append(f"{type(error).__module__}.{type(error).__name__}")


def main(cases: list[list[str]], destination: str) -> None:
    results = []
    for name, verb, location, architecture in cases:
        hostile = _hostile.Hostile(Path(location), Path(location), architecture)
        # The model restored into is built before, not measured.
        model = _hostile.model_for(hostile) if verb == "restore_sharded" else None
        raised: list[str] = []
        target = Path(destination) / name / verb
        growth = peak_growth(functools.partial(_run, verb, hostile, target, model, raised))
        results.append([raised[0] if raised else "nothing raised", growth])
    print(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
