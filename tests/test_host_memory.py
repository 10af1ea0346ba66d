"""glibc's malloc keeps what a step frees (model/host_memory.py): a block freed and asked for again is not mapped
and zeroed afresh by the OS."""

import ctypes
import ctypes.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import ctypes, ctypes.util, resource, sys
from model.host_memory import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 16 << 20  # a large intermediate of a step (a 1024-token gpt2 prefill's MLP input is 12 MiB)
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def second_use_faults(mode: str) -> int:
    """Page faults of writing a 16 MiB block again after freeing it, in a fresh process."""
    probe = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(probe.stdout)


def huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: a 16 MiB block then faults in 2 MiB pages, a handful."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
@pytest.mark.skipif(huge_pages_always(), reason="faults counted in huge pages cannot tell the two apart")
def test_a_freed_large_block_is_reused_without_page_faults():
    pages = (16 << 20) // 4096
    assert second_use_faults("default") > pages // 2  # glibc's default: unmapped on free, mapped afresh
    assert second_use_faults("kept") < pages // 20  # kept in the heap: its pages are already there


def test_elsewhere_it_says_so_rather_than_failing(monkeypatch):
    from model import host_memory

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "no-such-libc.so")
    assert host_memory.keep_freed_memory() is False
