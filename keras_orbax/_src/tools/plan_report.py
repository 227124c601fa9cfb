"""`plan`: what `restore_sharded` would do for a model under the active distribution, without
reading any array: keys missing, unexpected and mismatched, and the bytes each device and each
process would read.

```python
keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
with keras_orbax.deferred_init():
    model = build_model()
print(plan_restore_report(model, "/ckpt"))
```
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import keras

from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.model.matching import counted
from keras_orbax._src.runtime.progress import human_bytes
from keras_orbax._src.sources import resolve


@dataclasses.dataclass(frozen=True)
class RestorePlanReport:
    """What a restore would do. `problems` empty means a strict restore would go ahead."""

    source: str
    step: int | None
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]
    problems: list[str]
    reads: int
    nbytes: int  # one copy of every array read
    device_bytes: dict[str, int]
    process_bytes: dict[int, int]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        where = self.source if self.step is None else f"{self.source}@{self.step}"
        verdict = (
            "would restore"
            if not self.problems
            else f"would fail: {counted(len(self.problems), 'problem')}"
        )
        lines = [f"{where}: {verdict}; {self.reads} arrays, {human_bytes(self.nbytes)}"]
        lines += [f"  missing     {key}" for key in self.missing]
        lines += [f"  unexpected  {key}" for key in self.unexpected]
        lines += [f"  mismatched  {key}" for key in self.mismatched]
        lines += [f"  problem     {p}" for p in self.problems]
        lines.append("bytes read per process:")
        lines += [
            f"  process {p}  {human_bytes(n)}  ({n} B)" for p, n in self.process_bytes.items()
        ]
        lines.append("bytes read per device:")
        lines += [f"  {d}  {human_bytes(n)}  ({n} B)" for d, n in self.device_bytes.items()]
        return "\n".join(lines)


def plan_restore_report(
    model: keras.Model,
    source: str | os.PathLike,
    step: int | None = None,
    *,
    processes: int | None = None,
) -> RestorePlanReport:
    """Plans `restore_sharded(model, source, step)` and reports it; reads no array data.

    Args:
        model: The model, built normally or under `deferred_init()`, under the target distribution.
        source: Any location `restore_sharded` takes (a checkpoint root or step, a directory of
            Keras's `OrbaxCheckpoint`, a weights file, a preset or a Hugging Face directory).
        step: The step; `None` means the latest.
        processes: Count the devices as split over this many processes, in device order, as
            `jax.distributed` would (to plan a multi-host restore from one machine). `None`: each
            device's own `process_index`.

    Raises:
        ValueError: `processes` does not divide the devices the model is placed on.
    """
    opened = resolve.open_source(source, step)
    prepared = opened.prepare(model, strict=True)
    plan, problems = prepared.plan, list(prepared.problems)
    devices: dict[Any, int] = {}
    regions: dict[int, set[tuple[str, str]]] = {}
    process_bytes: dict[int, int] = {}
    used = {d for r in plan.reads.values() for d in r.target.sharding.device_set}
    order = {d: i for i, d in enumerate(sorted(used, key=lambda d: d.id))}
    if processes is not None and (processes < 1 or len(order) % processes):
        raise ValueError(
            f"processes must divide the {len(order)} devices the model is placed on, as each "
            f"process of jax.distributed holds as many. Received: processes={processes}"
        )
    nbytes = 0
    for key, request in plan.reads.items():
        itemsize = np_dtype(request.record.dtype).itemsize
        shape = tuple(request.target.shape)
        nbytes += math.prod(shape) * itemsize
        for device, index in request.target.sharding.devices_indices_map(shape).items():
            size = math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
            devices[device] = devices.get(device, 0) + size * itemsize
            process = _process(device, order, processes)
            seen = regions.setdefault(process, set())
            if (key, repr(index)) not in seen:  # a process reads each distinct region once
                seen.add((key, repr(index)))
                process_bytes[process] = process_bytes.get(process, 0) + size * itemsize
    ordered = sorted(devices, key=lambda d: order.get(d, 0))
    return RestorePlanReport(
        source=str(opened.location),
        step=opened.step,
        missing=list(plan.missing),
        unexpected=list(plan.unexpected),
        mismatched=list(plan.mismatched),
        problems=list(problems),
        reads=len(plan.reads),
        nbytes=nbytes,
        device_bytes={str(d): devices[d] for d in ordered},
        process_bytes=dict(sorted(process_bytes.items())),
    )


def _process(device: Any, order: dict[Any, int], processes: int | None) -> int:
    if processes is None:
        return int(device.process_index)
    return order[device] // (len(order) // processes)
