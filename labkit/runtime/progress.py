"""`labkit.progress`: a progress bar per rank, drawn live in the calling cell.

    def train(rank, world_size):
        for step in labkit.progress(range(100), desc="train"):
            ...

On a labkit rank each bar reports to the kernel over the rank's call connection
(at most every 0.1 s, and once at the end). Elsewhere (a plain script, torchrun)
it is a tqdm bar on stderr.
"""

from __future__ import annotations

import time

from labkit.runtime import wire
from labkit.runtime.messages import Progress
from labkit.runtime.rank import CONNECTION, STATE

EVERY = 0.1  # seconds between reports, at most


def progress(iterable, desc: str = "", total: int | None = None):
    """Yield from `iterable`, reporting how far along this rank is."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if CONNECTION["main"] is None or STATE["call"] is None:
        from tqdm.auto import tqdm

        yield from tqdm(iterable, desc=desc, total=total)
        return
    STATE["bars"] += 1
    bar, call_id = STATE["bars"], STATE["call"]
    t0 = last = time.monotonic()
    n = 0
    _report(Progress(call_id, bar, desc, 0, total, 0.0))
    for item in iterable:
        yield item
        n += 1
        now = time.monotonic()
        if now - last >= EVERY:
            _report(Progress(call_id, bar, desc, n, total, now - t0))
            last = now
    _report(Progress(call_id, bar, desc, n, total, time.monotonic() - t0, done=True))


def _report(msg: Progress) -> None:
    import cloudpickle

    data = cloudpickle.dumps(msg, protocol=5)
    with CONNECTION["lock"]:
        wire.send_bytes(CONNECTION["main"], data)
