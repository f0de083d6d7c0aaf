"""Process-wide settings each part applies once it has started."""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Exempt every object alive now from the cyclic garbage collector (`gc.freeze`).

    What a part builds at start-up (the gateway's tokenizer and FastAPI app, the worker's model,
    the imported libraries) lives as long as the process, yet every full collection walked all
    of it again: `perf` put 30% of the gateway's CPU in `gc_collect_main` and its traversals
    while it streamed W64, CPU the worker on the same cores then lacked. Objects made later are
    collected as usual.
    """
    gc.collect()
    gc.freeze()
