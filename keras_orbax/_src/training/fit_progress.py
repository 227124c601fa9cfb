"""Where `fit` is, as `ModelCheckpoint` counts it: the global step, the epoch, the last batch
trained in it, and the (epoch, batch) a save records."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FitProgress:
    """The global step (batches trained, counted across restarts), the 0-based epoch `fit` is in,
    and the last batch of it trained (None before the first)."""

    step: int = 0
    epoch: int = 0
    last_batch: int | None = None

    def begin_epoch(self, epoch: int) -> None:
        self.epoch, self.last_batch = epoch, None

    def end_batch(self, batch: int) -> int:
        """Counts batch `batch` of the epoch as trained; returns the step before it."""
        previous = self.step
        self.step += batch + 1 if self.last_batch is None else batch - self.last_batch
        self.last_batch = batch
        return previous

    def position(self, at_epoch_end: bool, steps: int | None) -> tuple[int, int | None]:
        """(epoch, batch) to record: the next epoch to run, or the batches done in this one.

        After a batch, the epoch is done only if that was its known last batch (`steps` per
        epoch; a generator's length is unknown: its epoch counts as unfinished). At an epoch's end,
        it is done unless it stopped before its known number of batches (another callback stopped
        `fit`).
        """
        done = 0 if self.last_batch is None else self.last_batch + 1
        finished = (
            (steps is None or done >= steps)
            if at_epoch_end
            else (steps is not None and done >= steps)
        )
        return (self.epoch + 1, None) if finished else (self.epoch, done)
