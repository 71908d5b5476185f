"""`reuse_host_memory` (bench/common.py, the benches' `--reuse-host-memory`): a buffer freed by one
call is reused by the next instead of being mapped and zero-filled again, which is what costs XLA's
CPU programs a page fault per 4 KiB of scratch per call."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from common import _MALLOC_ENVIRONMENT  # noqa: E402 (bench/common.py)

pytestmark = [
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
    ),
    pytest.mark.slow,  # each probe is a new Python process that imports the bench's JAX
]

# Allocates, fills and frees a 128 MiB buffer from a worker thread, as XLA does its scratch, and
# prints glibc's account of it: the bytes mapped apart from the heap while it is held, and the free
# bytes the heap keeps once it is freed.
_PROBE = textwrap.dedent(
    """
    import ctypes, sys, threading
    sys.path.insert(0, sys.argv[2])
    from common import reuse_host_memory
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_int) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes, libc.mallinfo.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
    print(reuse_host_memory() if sys.argv[1] == "reuse" else None)
    def fill():
        buffer = libc.malloc(128 << 20)
        ctypes.memset(buffer, 1, 128 << 20)
        print(libc.mallinfo().hblkhd >> 20)
        libc.free(buffer)
        print(libc.mallinfo().fordblks >> 20)
    worker = threading.Thread(target=fill)
    worker.start(), worker.join()
    """
)


def _mapped_and_kept_mib(mode: str, **environment: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENVIRONMENT} | environment
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, str(BENCH)], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_a_freed_buffer_stays_in_the_heap_for_the_next_call():
    # By default the buffer is mapped apart and unmapped when freed: the next call faults it in again.
    was_set, mapped, kept = _mapped_and_kept_mib("default")
    assert (was_set, int(mapped) >= 128, int(kept) < 128) == ("None", True, True)
    was_set, mapped, kept = _mapped_and_kept_mib("reuse")
    assert (was_set, int(mapped) < 128, int(kept) >= 128) == ("True", True, True)


def test_an_allocator_chosen_in_the_environment_is_left_alone():
    was_set, mapped, kept = _mapped_and_kept_mib("reuse", MALLOC_ARENA_MAX="4")
    assert (was_set, int(mapped) >= 128, int(kept) < 128) == ("False", True, True)
