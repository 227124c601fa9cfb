"""Telling an I/O error (the system failed to read: EIO, EACCES, ESTALE, a mount gone) from
damage (the bytes read are not those written, a file is missing), and retrying the first.

A read that fails with an I/O error may pass (an NFS server back, a permission put right), so a
caller that would give a step up (resume moves it aside) tries again a few times first; damage
does not pass, and is not retried.

```python
restored = retried(lambda: restore(step), f"restoring step {step}")
why = cause(error)      # "an I/O error (errno 5, EIO: Input/output error)" or "damage"
```
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger("keras_orbax")

ATTEMPTS = 3
BACKOFF_S = (0.25, 1.0)  # the waits before the second and the third attempt
_NOT_IO = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)  # a file missing or replaced: damage


def io_errno(error: BaseException) -> int | None:
    """The errno of the I/O error behind `error` (itself, or one of its causes); None if it is
    damage. Under `jax.distributed`, an error agreed across processes carries the errno of the
    process that failed (`multihost.agree`), so every process gives the same answer."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = current.errno if isinstance(current, OSError) else None
        if isinstance(code, int) and code not in _NOT_IO:
            return code
        current = current.__cause__ or current.__context__
    return None


def cause(error: BaseException) -> str:
    """What `error` was, in words: an I/O error with its errno, or damage."""
    code = io_errno(error)
    if code is None:
        return "damage"
    name = errno.errorcode.get(code, "?")
    return f"an I/O error (errno {code}, {name}: {os.strerror(code)})"


def retried(
    attempt: Callable[[], T], what: str, before_retry: Callable[[], None] = lambda: None
) -> T:
    """`attempt()`, tried again after a short wait (`BACKOFF_S`) while it fails with an I/O error,
    `ATTEMPTS` times in all; each retry is logged. `before_retry()` runs before each retry (a
    test's fault injection).

    Raises:
        What the last attempt raised; at once what is not an I/O error.
    """
    for n in range(ATTEMPTS):
        try:
            return attempt()
        except Exception as error:
            if n == ATTEMPTS - 1 or io_errno(error) is None:
                raise
            logger.warning(
                "%s failed with %s; trying again in %.2f s (attempt %d of %d): %s",
                what, cause(error), BACKOFF_S[n], n + 2, ATTEMPTS, error,
            )  # fmt: skip
            time.sleep(BACKOFF_S[n])
            before_retry()
    raise AssertionError("unreachable")
