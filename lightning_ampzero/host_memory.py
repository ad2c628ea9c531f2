"""``keep_freed_host_memory(cache_mb)``: let a training process reuse the host memory it frees.

[Note: page faults per step]
A training step allocates and frees the same host buffers every step: activations, gradients,
and under ZeRO (FSDP2) the all-gather outputs and reduce-scatter inputs, which DDP keeps in
persistent buckets instead. PyTorch's CPU allocator has no cache; it calls ``malloc``/``free``,
and glibc's defaults hand a large freed block back to the kernel (``munmap``, or trimming the
top of the heap past 2x the dynamic mmap threshold), so the next step takes a fresh page fault,
and the kernel zeroes the page, for every 4 KiB it touches again. Measured on the benchmark GPT
(4 x 256, batch 4 x 128, one process, one thread, torch 2.13, glibc 2.36): 3,100-3,200 minor
faults a step and 61-63 ms in bf16-mixed, against 0-20 faults and 53 ms with the trim threshold
below and the mmap threshold raised to 32 MiB, the first setting of this module (fp32: 1,300-1,500
faults, 118-120 ms against 116-118 ms); on that model every block is under 32 MiB, so it gets the
same from the two settings below.

Two ``mallopt`` settings:

* ``M_MMAP_MAX`` = 0: no block is served by its own mapping. glibc maps every block above its
  mmap threshold (128 KiB, growing by itself to at most 32 MiB, the most ``M_MMAP_THRESHOLD``
  accepts) and unmaps it on ``free``, so such a block is faulted in, and zeroed by the kernel,
  anew every step. On the 4 x 256 GPT every buffer is under 32 MiB, but a model of 20M parameters
  has 80 MiB gradient buffers: a 6 x 1024 GPT (75M parameters, 2 ranks, bf16-mixed) took 843 ms
  a step at stage 2 with only the threshold raised to 32 MiB, 687 ms with no mappings (DDP 657 ms:
  1.28x -> 1.05x); stage 3 966 -> 626 ms, fp32 stage 2 1793 -> 1460 ms; peak resident memory
  within 7%. A Hugging Face GPT-2 (81M parameters, a plain Trainer script): stage 2 943 -> 574 ms,
  stage 3 1464 -> 650-890 ms, peak resident memory +14% and +33-40% (benchmarks/README.md). Without
  mappings every block comes from a heap, where a freed block is reused by the next request that
  fits; glibc before 2.38 reuses PyTorch's 64-byte-aligned large blocks only once a few steps have
  laid them out, and keeps more of them resident meanwhile (the large-block pattern of
  tests/test_host_memory.py, 4 blocks of 64 MiB allocated and freed per round: no fault from the
  fifth round on, and 1.2 GiB resident against 0.2 GiB with glibc's defaults).
* ``M_TRIM_THRESHOLD`` = ``cache_mb``: free memory at the top of a heap is kept up to this much
  instead of being returned to the kernel after each step's peak (glibc's default trims past
  128 KiB, or twice the dynamic threshold: up to 64 MiB).

The cost is resident memory: after a peak a process keeps up to ``cache_mb`` of freed memory at
the top of each heap (arena), and any freed block below a live one (as before for blocks under
the threshold), as a caching GPU allocator does. ``cache_mb=0`` leaves glibc's defaults. Under
ZeRO-Infinity (parameters on NVMe), where the point is to hold less than the model in memory, the
strategy keeps blocks over 32 MiB mapped (``M_MMAP_THRESHOLD`` = 32 MiB, glibc's ceiling, instead
of ``M_MMAP_MAX`` = 0: either one turns glibc's dynamic thresholds off, and the threshold alone would
leave every block over 128 KiB mapped): its gathered units are returned to the kernel after use,
page faults and all (docs/offload.md). Other C libraries (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

#: glibc's malloc.h parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
#: The ceiling of glibc's dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), the most it accepts.
MMAP_THRESHOLD_BYTES = 32 << 20
#: mallopt takes a C int.
MAX_CACHE_MB = (2**31 - 1) >> 20


def _glibc() -> "ctypes.CDLL | None":
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_host_memory(cache_mb: int, *, map_large_blocks: bool = False) -> bool:
    """Set this process's glibc malloc to keep up to ``cache_mb`` MiB of freed memory for reuse.

    ``map_large_blocks``: blocks over 32 MiB keep mappings of their own (the mmap threshold raised to
    that ceiling instead of ``M_MMAP_MAX=0``), where resident memory matters more than their page
    faults: the strategy asks for it under ZeRO-Infinity (``offload_param='nvme'``).
    Returns whether the settings took (False: ``cache_mb`` is 0, or the C library is not glibc).
    Process-wide and lasting; see [Note: page faults per step].
    """
    if not 0 <= cache_mb <= MAX_CACHE_MB:
        raise ValueError(f"cache_mb must be between 0 and {MAX_CACHE_MB}, got {cache_mb!r}.")
    libc = _glibc() if cache_mb else None
    if libc is None:
        return False
    if map_large_blocks:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    else:
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(cache_mb) << 20) == 1
    if not ok:  # pragma: no cover - glibc accepts both values
        log.warning("mallopt refused the host-memory settings; glibc's defaults stay.")
    return ok
