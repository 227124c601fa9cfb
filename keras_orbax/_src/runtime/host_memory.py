"""Host memory outside NumPy's allocator: freed pages handed back to the kernel (glibc's
`malloc_trim`), and the unused end of a mapping closed to faults (`mprotect`).

glibc raises its `mmap` threshold each time a block it had `mmap`ed is freed (up to 32 MiB), so
later blocks of that size come from its heaps, one per thread, where freed pages stay resident. A
Hugging Face export computes some tensors with keras-hub's operations (XLA's results, one tensor
at a time, on XLA's threads): their freed pages piled up beside the model, tensor after tensor
(docs/benchmarks.md, "Exports"). `malloc_trim(0)` returns every heap's free pages.
"""

from __future__ import annotations

import ctypes
import mmap

from keras_orbax._src.runtime import libc


def release_freed() -> None:
    """Returns the free pages of glibc's heaps to the kernel; nothing where glibc is not the C
    library.

    ```python
    del computed  # the last reference to a large array
    release_freed()
    ```
    """
    trim = libc.function("malloc_trim", ctypes.c_int, ctypes.c_size_t)  # glibc's own
    if trim is not None:
        trim(0)


def close_to_faults(address: int, length: int) -> bool:
    """Makes `length` bytes of a mapping, from the page-aligned `address`, inaccessible
    (`PROT_NONE`): a part never used, split off so that no page of it is ever backed. Where
    memory is backed in 2 MiB units (transparent huge pages set to `always`; gVisor backs private
    memory so), a fault in the last partial unit of a buffer would otherwise back the whole unit.
    Returns whether it was done.

    ```python
    close_to_faults(base + used, mapping_length - used)
    ```
    """
    protect = libc.function(
        "mprotect", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    )
    if protect is None or length <= 0:
        return False
    return protect(address, length, getattr(mmap, "PROT_NONE", 0)) == 0
