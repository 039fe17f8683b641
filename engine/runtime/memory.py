"""Memory the engine holds: warm buffers, huge pages, freed memory kept for reuse, and what
counts against a preset's budget."""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint import aligned_buffer

# What a run's Python side holds beyond its arrays: token records, events, the report,
# numpy temporaries and the I/O threads' stacks (a few MiB on the demo model, with headroom).
BOOKKEEPING_BYTES = 16 << 20

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20    # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 1 << 30     # free heap memory kept, up to this, for the next allocations
TOP_PAD = 256 << 20          # the heap grows by this much beyond a request (address space only)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
PAGE_MODES = ("huge", "normal", "default")


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks up to MMAP_THRESHOLD from the heap and to keep freed
    heap memory for the next allocations, instead of a fresh mapping per large block that is
    unmapped when freed. A prefill layer allocates and frees hundreds of MB of numpy temporaries;
    each fresh mapping faults once per 4 KiB page as it is first written (measured on the bench
    model, a 512-token chunk: 1.8 s of system time, 0.6 s with this, and 5% less wall time).
    What is kept stays within the temporaries' peak, which the memory plan counts. Process-wide
    and idempotent; False (nothing changed) where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim, every arena), as a run
    ends: keep_freed_memory keeps a layer's freed temporaries for the next layer, which is right
    within a run, but after it they would stay in the process's RSS with nothing in the plan to
    count them (a run thread's arena, a batch's). A few milliseconds; the next run's first layer
    faults its temporaries in again. False (nothing done) where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page setting ("always", "madvise" or "never"), or None
    where there is none to read (not Linux, or THP compiled out)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def huge_page_size() -> int:
    """Bytes of a transparent huge page (2 MiB on x86-64 if the kernel does not say)."""
    try:
        return int(THP_PMD_SIZE.read_text())
    except (OSError, ValueError):
        return 2 << 20


def thp_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give a region huge pages here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise") and thp_mode() in ("always", "madvise")


def page_buffer(nbytes: int, pages: str = "huge") -> tuple[np.ndarray, bool]:
    """A zeroed, writable uint8 array of nbytes in an anonymous mapping of its own, and whether it
    was given transparent huge pages.

    pages="huge": the array starts on a huge-page boundary and its region is advised
    MADV_HUGEPAGE, so the kernel backs it with huge pages as it faults in (fewer TLB misses on
    large streaming reads).  Where the OS has no THP, Python no madvise, or THP is "never", the
    array is an ordinary page-aligned one and the flag is False: no error.  A True flag says the
    request was taken, not that every page is huge (the kernel may lack free huge pages:
    huge_page_bytes() reads what it did).
    pages="normal": 4 KiB pages even where THP is "always" (MADV_NOHUGEPAGE where available).
    pages="default": whatever the system does for anonymous memory (no advice)."""
    if pages not in PAGE_MODES:
        raise ValueError(f"pages: expected one of {', '.join(PAGE_MODES)}, got {pages!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    want_huge = pages == "huge" and thp_available()
    align = huge_page_size() if want_huge else mmap.PAGESIZE
    length = max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)
    size = length + (align - mmap.PAGESIZE if want_huge else 0)
    # private, not mmap's default shared mapping: shared anonymous memory is shmem, which THP
    # leaves to shmem_enabled (usually never) whatever the madvise says
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows
        m = mmap.mmap(-1, size)
    base = np.frombuffer(m, dtype=np.uint8)
    offset = -base.__array_interface__["data"][0] % align
    thp = False
    if want_huge:
        try:
            m.madvise(mmap.MADV_HUGEPAGE, offset, length)
            thp = True
        except (OSError, ValueError):
            thp = False
    elif pages == "normal" and hasattr(mmap, "MADV_NOHUGEPAGE") and hasattr(mmap.mmap, "madvise"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except (OSError, ValueError):
            pass
    del base
    return np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=offset), thp


def huge_page_bytes(buf: np.ndarray) -> int | None:
    """Bytes of the mappings holding `buf` that the kernel backs with transparent huge pages now
    (AnonHugePages of /proc/self/smaps), or None where smaps cannot be read."""
    start = buf.__array_interface__["data"][0]
    end = start + buf.nbytes
    total, inside = 0, False
    try:
        with open(f"/proc/{os.getpid()}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and ":" not in head:  # a mapping's header line: lo-hi perms ...
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo < end and hi > start
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def llc_bytes() -> int | None:
    """Bytes of the last-level cache of CPU 0 (the highest level of data or unified cache
    sysfs lists, else glibc's sysconf), or None where neither says."""
    best = (0, 0)  # (level, bytes)
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in root.glob("index*"):
            try:
                if (index / "type").read_text().strip() not in ("Data", "Unified"):
                    continue
                level = int((index / "level").read_text())
                size = (index / "size").read_text().strip().upper()
            except (OSError, ValueError):
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            try:
                nbytes = int(size.rstrip("KMG")) * mult
            except ValueError:
                continue
            best = max(best, (level, nbytes))
    except OSError:
        pass
    if best[1]:
        return best[1]
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            n = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if n and n > 0:
            return int(n)
    return None


def available_bytes() -> int:
    """RAM the OS could give this process now without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def warm_buffer(nbytes: int, huge: bool = False) -> np.ndarray:
    """A page-aligned buffer for direct reads, every page faulted in now rather than mid-token;
    with huge=True on transparent huge pages where the OS offers them (page_buffer)."""
    buf = page_buffer(nbytes, "huge")[0] if huge else aligned_buffer(nbytes)
    buf[::mmap.PAGESIZE] = 0
    return buf
