"""glibc's malloc told to keep the memory a step frees, for the next step to reuse.

By default glibc serves an allocation above its threshold (128 KiB, rising to the largest block freed so far) with
a fresh mapping and unmaps it when freed, and gives the free top of a heap back to the OS past another threshold.
A step's intermediates are megabytes each (a 1024-token gpt2 prefill's MLP input is 12 MiB), so each step wrote
its tensors to pages the OS had to map and zero first: 94 000 page faults in that step, 75 000 of them for
intermediates (the rest first writes to KV blocks), 1.9 s -> 1.7 s without them (Zen 3). A heap that keeps
what it held costs the step's peak of intermediates, tens to a few hundred MiB, once.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # the most glibc accepts: a larger block is still mapped and unmapped on its own
TRIM_THRESHOLD = 2**31 - 1  # the largest it takes (an int): in effect, keep a heap's free top


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False where the C library is not glibc (or refuses)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # no mallopt: musl, macOS
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not kept:
        log.warning("glibc's malloc refused its thresholds: large tensors are mapped afresh at every step")
    return kept
