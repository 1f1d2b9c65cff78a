"""Heap memory a batch-at-a-time process keeps from one batch to the next.

# start-up --> touch N MiB of small-object arenas, pin each --> later batches reuse them

CPython's small-object allocator takes memory from the kernel in 1 MiB arenas and gives
an arena back as soon as every object in it is gone (glibc's malloc, under Python's
larger objects, likewise trims the top of its heap). The billing sink allocates a
batch's objects (fetched records, decoded events, keys, columns), frees them all, and
does it again for the next batch: each batch faults its memory in afresh, and the
kernel clears every new page first. On the development machine (a microVM, where a
page the guest gave back costs the host a fault too) ``perf`` found 45% of the sink
process's CPU in ``clear_page_erms`` during ``python -m bench.billing_ingest``, at 0.37
minor faults per event; a quarter of that was the sink's Python objects, which is what
this keeps (the rest is chdb's own allocator).

``reserve_heap`` fills ``mib`` MiB of arenas with small objects at start-up and keeps one
of them in every 256 KiB, freeing the rest: an arena with an object in it is never given
back, and its emptied pools serve allocations of any size. glibc is told to keep what
is freed (``mallopt``: no trim below the reserve, no ``mmap`` below 32 MiB). A batch
whose objects fit in the reserve then faults nothing in. The cost is the reserve's
resident memory, held while the process lives; a batch that needs more grows the heap
past it as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_PIN_SHIFT = 18
"""One object kept per 2**18 bytes (256 KiB) of addresses: every 1 MiB arena, however
aligned, holds at least three such spans whole, so keeps an object."""
_OBJECT_BYTES = 100
"""Each filler is ``bytes`` of this length: 144 bytes of arena, not tracked by the collector."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit: blocks below it come from the heap."""


def reserve_heap(mib: int) -> list[bytes]:
    """Keeps ``mib`` MiB of small-object arenas (and glibc's freed heap) for the process's
    life; returns the objects that pin them, which the caller keeps (0: nothing)."""
    if mib <= 0:
        return []
    _keep_freed_malloc(mib << 20)
    fillers = [bytes(_OBJECT_BYTES) for _ in range((mib << 20) // (_OBJECT_BYTES + 44))]
    spans: dict[int, bytes] = {}
    for filler in fillers:
        spans.setdefault(id(filler) >> _PIN_SHIFT, filler)
    del fillers
    pins = list(spans.values())
    log.info("heap reserve: %d MiB of arenas kept by %d objects", mib, len(pins))
    return pins


def _keep_freed_malloc(trim_threshold: int) -> bool:
    """glibc keeps up to ``trim_threshold`` bytes it frees, and serves blocks below 32 MiB
    from its heap; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    trim = min(trim_threshold, 2**31 - 1)
    return bool(mallopt(_M_TRIM_THRESHOLD, trim)) and bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    )
