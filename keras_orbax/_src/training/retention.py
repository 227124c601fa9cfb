"""Which steps a `ModelCheckpoint` keeps, and deleting the others once a new step is durable.

Orbax's `Checkpointer` given a preservation policy deletes old steps while it finalizes a save:
after the new step's rename, before keras-orbax has fsynced Orbax's metadata files and that rename
(`step_sink.DurableResponse`). A power loss in between could leave `max_to_keep=1` with no step
to resume from. So the checkpointer gets no policy, and `Retention.prune` applies the same Orbax
policies itself, called only once the new step is durable (`tests/test_durability_order.py`).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.write import step_sink

logger = logging.getLogger("keras_orbax")

_policies = ocp.training.preservation_policies


class Retention:
    """The rules of retention: the latest `max_to_keep`, the `keep_best` best by `monitor`,
    every multiple of `keep_every`; a step is kept if any rule keeps it.

    `higher_is_better` is set by the callback once the monitor's direction is known (Keras infers
    it from the metric when `mode="auto"`); until then, lower is better.
    """

    def __init__(
        self,
        monitor: str,
        *,
        max_to_keep: int | None,
        keep_best: int | None,
        keep_every: int | None,
    ) -> None:
        self.monitor = monitor
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.keep_every = keep_every
        self.higher_is_better = False

    def policy(self) -> Any:
        """The Orbax v1 preservation policy for these rules."""
        policies: list[Any] = [_policies.LatestN(self.max_to_keep)]
        if self.keep_best:
            policies.append(
                _policies.BestN(
                    get_metric_fn=self.rank,
                    n=self.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        if self.keep_every:
            policies.append(_policies.EveryNSteps(self.keep_every))
        return policies[0] if len(policies) == 1 else _policies.AnyPreservationPolicy(policies)

    def prune(
        self,
        checkpointer: ocp.training.Checkpointer,
        *,
        retire: Callable[[int], object] | None = None,
        rescan: bool = True,
    ) -> list[int]:
        """Deletes the steps of `checkpointer` that no rule keeps; returns them. With `retire`,
        the oldest of them is handed to it instead (which moves it out of the steps, for its
        files to be written into: `recycled_step`), and deleted where that fails. With
        `rescan`, the directory's steps are listed again first.

        Call on every process (Orbax's deletion is collective; process 0 deletes), and only once
        the newest step is durable: nothing is deleted before a step to resume from is on disk.
        """
        # Every step of the directory, not only those this checkpointer wrote (a `save` into it
        # meanwhile, or a second run where no lock keeps one out: object storage).
        if rescan:
            checkpointer.reload()
        checkpoints = list(checkpointer.checkpoints)
        kept = self.policy().should_preserve(checkpoints, context=_policies.PreservationContext())
        doomed = [c.step for c, keep in zip(checkpoints, kept, strict=True) if not keep]
        for step in doomed:
            if retire is not None and step == doomed[0]:
                try:
                    retire(step)
                except OSError as error:
                    logger.debug("Deleting step %d rather than retiring it: %s", step, error)
            with step_sink.orbax_operation():  # a retired step: only taken off Orbax's list
                checkpointer.delete(step, missing_ok=True)
        return doomed

    def rank(self, metrics: Any) -> float:
        """Higher is better: `monitor`'s value, negated when lower is better; -inf where missing."""
        value = metric(metrics, self.monitor)
        if value is None:
            return -math.inf
        return value if self.higher_is_better else -value

    def best(self, values: Iterable[float | None]) -> float | None:
        """The best of `values` (None entries ignored); None if there is none."""
        found = [v for v in values if v is not None]
        if not found:
            return None
        return max(found) if self.higher_is_better else min(found)


def metric(metrics: Any, name: str) -> float | None:
    """`metrics[name]` as a finite float, or None."""
    value = number(metrics.get(name)) if isinstance(metrics, dict) else None
    return value if value is not None and math.isfinite(value) else None


def number(value: Any) -> float | None:
    """`value` as a float where it is a real scalar, as Keras's callbacks take one: a Python or
    NumPy number, or a 0-d array (a user's callback may log `np.mean(...)`); else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | np.generic):
        return None
    array = np.asarray(value)
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.number):
        return None
    return float(array)


def loggable(logs: dict) -> dict[str, float] | None:
    """The logs as JSON-safe numbers, stored with the step (Orbax's `metrics`)."""
    values = {k: v for k, v in ((k, number(v)) for k, v in logs.items()) if v is not None}
    return {k: v for k, v in values.items() if math.isfinite(v)} or None
