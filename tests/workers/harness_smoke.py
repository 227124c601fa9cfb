"""Worker for tests/test_harness.py: reports its place in the cluster, or fails on request.

args: {"fail_on": [process ids that raise right after joining the cluster]}
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from tests._worker_util import init_worker, write_result


def main() -> None:
    ctx = init_worker()
    if ctx.process_id in (ctx.args or {}).get("fail_on", []):
        raise RuntimeError(f"deliberate failure on process {ctx.process_id}")
    # A collective: blocks until every process joins, so it hangs if a peer died.
    gathered = multihost_utils.process_allgather(np.array([jax.process_index()]))
    write_result(
        {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "gathered": np.asarray(gathered).ravel(),
        }
    )


if __name__ == "__main__":
    main()
