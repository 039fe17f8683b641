"""Memory the engine holds: warm buffers, and what counts against a preset's budget."""
from __future__ import annotations

import mmap

import numpy as np

from ds4f.engine.checkpoint import aligned_buffer

# What a run's Python side holds beyond its arrays: token records, events, the report,
# numpy temporaries and the I/O threads' stacks (a few MiB on the demo model, with headroom).
BOOKKEEPING_BYTES = 16 << 20


def warm_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned buffer for direct reads, every page faulted in now rather than mid-token."""
    buf = aligned_buffer(nbytes)
    buf[::mmap.PAGESIZE] = 0
    return buf
