"""A run's routing trace for the cache lab: read from the run's state dump (state.bin) or from
an exported trace (.npz, ds4f.cachelab.trace's format), and exported compactly."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ds4f.cachelab.trace import Trace, read_trace_file, write_trace_file
from ds4f.engine.model.geometry import Geometry
from ds4f.errors import Ds4fError
from ds4f.safe_read import open_regular
from ds4f.runs.statedump import MAGIC, read_state


def load_trace(path: str | os.PathLike) -> Trace:
    """A trace from a state dump (state.bin) or an exported trace (.npz)."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        raise Ds4fError(f"{path}: trace not found")
    with open_regular(path, "trace") as (f, _st):    # a FIFO or a device is refused, never waited on
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            f.seek(0)
            return read_trace_file(path, f)
    state = read_state(path)
    geometry = Geometry.from_config(state.header["geometry"], str(path))
    return Trace(geometry, np.array(state.records["ids"], dtype=np.int32),
                 np.array(state.records["token"], dtype=np.int32), str(path))


def export_trace(state_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the compact trace of a state dump: expert ids as uint16, token ids, geometry."""
    return write_trace_file(load_trace(state_path), out, source=str(state_path))
