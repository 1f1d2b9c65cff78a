"""The cycle collector of a long-running service: start-up's objects out of its way, and
its youngest generation collected less often.

# after start-up --> collect once, freeze what is left --> young generation of N

CPython's full collection walks every tracked object. A service holds hundreds of
thousands that live as long as it does (modules, clients, the engine's and the
tokenizer's structures), and each full collection walks them all again while the event
loop waits: measured on the 2-core development machine, a worker process with vLLM
loaded held 626k objects and a full collection took about 360 ms; the Faust job 83k
(38 ms), the bridge 68k (21 ms). One such pause in a wave of requests is its TTFT p99.
``gc.freeze()`` once start-up is over (as vLLM's engine core and the billing sink do)
moves them to the permanent generation: later collections walk only what came after.
The cost is that cycles among start-up's own garbage are never collected; one
collection just before the freeze frees those.

CPython also collects its youngest generation after every 700 net allocations of
tracked objects, and every tenth of those collections the next one, and every tenth of
those a full one. A hot path that allocates a few hundred objects a request (decoded
messages, tasks, futures, spans) so ran a full collection every few hundred requests,
each walking everything held since the freeze: in an admission burst of 10,000 requests
the Faust job ran eight, the last ones 80 to 124 ms each, a tenth of its CPU. Nearly
everything the hot path makes dies by reference counting, so collecting the young
generation after ``gen0_threshold`` allocations instead costs little memory (what a
young collection finds is the live in-flight state, whatever the threshold) and leaves
the full collections to the rare moments the older generations fill.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(service: str, gen0_threshold: int = 0) -> int:
    """Collects once, then freezes what is left; with ``gen0_threshold`` > 0, collects
    the youngest generation after that many allocations from now on (0: CPython's
    thresholds as they are). Returns how many objects were frozen. Call once, when the
    service's start-up is over."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    if gen0_threshold > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, gen1, gen2)
    log.info(
        "%s: %d objects from start-up frozen out of the cycle collector; young generation "
        "collected every %d allocations",
        service,
        frozen,
        gc.get_threshold()[0],
    )
    return frozen
