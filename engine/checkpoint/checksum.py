"""crc32 of checkpoint records and regions: zlib's polynomial and values (what pool.json and
trunk.json store), computed by ISA-L when it is installed (several times zlib's speed: the I/O
threads check every expert record they read while the kernels compute on the same cores), else by
zlib. Both release the GIL. crc32(data, value=0), as zlib.crc32."""
from __future__ import annotations

try:
    from isal.isal_zlib import crc32
    IMPLEMENTATION = "isa-l"
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION"]
