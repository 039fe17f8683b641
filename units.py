"""Units as people read them: byte sizes. Below everything (the engine, runs, the front ends
through ds4f.api all print sizes one way)."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
