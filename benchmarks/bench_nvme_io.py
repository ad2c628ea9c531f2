"""Swap-file I/O: page cache (``pread``/``pwrite``, what offload/store.py and offload/params.py use)
against ``O_DIRECT``, with 1 to N threads (a benchmark, not a test).

ZeRO-Infinity's swap files are read and written in large contiguous pieces: an optimizer tile
(``sub_group_size`` fp32 elements) or a parameter segment (up to ``param_buffer_size`` elements).
DeepSpeed uses libaio with ``O_DIRECT``; this project uses ordinary file I/O on a thread pool
(``io_threads``). Issue 15 asks whether ``O_DIRECT`` (where the filesystem allows it) or more
threads gain. This measures, on the directory given:

* ``write``: ``--size`` bytes in ``--chunk`` pieces, then ``fsync`` (timed: page-cache writes are
  only done when the data is on the drive);
* ``read cold``: the same file read back after its pages were dropped from the page cache
  (``posix_fadvise(DONTNEED)`` after the fsync), i.e. from the drive;
* ``read warm`` (page cache only): read again without dropping, what a swap file that fits in
  free memory costs.

Each mode runs with 1, 2 and 4 threads, each thread taking every n-th chunk. ``O_DIRECT`` needs
buffers, offsets and lengths aligned to the logical block size: buffers come from anonymous
``mmap`` (page aligned) and the chunk is a multiple of 4 KiB.

Usage::

    python benchmarks/bench_nvme_io.py --dir /local_nvme [--size 2GiB] [--chunk 8MiB] [--repeat 2]

Writes ``benchmarks/results/nvme_io.json`` and ``.md`` (``--out`` to change the stem).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _parse_size(text: str) -> int:
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1, "": 1}
    t = text.strip().upper()
    for suffix in sorted(units, key=len, reverse=True):
        if suffix and t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(t)


def _run(path: Path, size: int, chunk: int, threads: int, direct: bool, what: str) -> float:
    """Seconds for one pass of ``what`` (write / read) over ``path`` with ``threads`` threads."""
    flags = os.O_RDWR | (os.O_CREAT if what == "write" else 0) | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    n = size // chunk
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page aligned, as O_DIRECT needs
    for b in buffers:
        b.write(os.urandom(4096) * (chunk // 4096))  # incompressible, every page touched

    def work(t: int) -> None:
        view = memoryview(buffers[t])
        for i in range(t, n, threads):
            done = 0
            while done < chunk:
                if what == "write":
                    done += os.pwritev(fd, [view[done:]], i * chunk + done)
                else:
                    got = os.preadv(fd, [view[done:]], i * chunk + done)
                    if got <= 0:
                        raise OSError(f"short read at {i * chunk + done} of {path}")
                    done += got

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    if what == "write":
        os.fsync(fd)
    seconds = time.perf_counter() - start
    os.close(fd)
    for b in buffers:
        b.close()
    return seconds


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        device, fstype = out.splitlines()[1].split()[:2]
        return f"{fstype} on {device}"
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="directory on the drive to measure (a file is created and deleted)")
    p.add_argument("--size", default="2GiB")
    p.add_argument("--chunk", default="8MiB")
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--repeat", type=int, default=2, help="passes per setting; the fastest is kept")
    p.add_argument("--out", default="nvme_io")
    args = p.parse_args()
    size, chunk = _parse_size(args.size), _parse_size(args.chunk)
    if chunk % 4096 or size % chunk:
        raise SystemExit("--chunk must be a multiple of 4 KiB and divide --size.")
    path = Path(args.dir) / f"ampzero-io-bench-{os.getpid()}.bin"
    rows = []
    try:
        for direct in (False, True):
            for threads in map(int, args.threads.split(",")):
                best = {"write": float("inf"), "read cold": float("inf"), "read warm": float("inf")}
                for _ in range(args.repeat):
                    try:
                        best["write"] = min(best["write"], _run(path, size, chunk, threads, direct, "write"))
                        _drop_cache(path)
                        best["read cold"] = min(best["read cold"], _run(path, size, chunk, threads, direct, "read"))
                        if not direct:  # O_DIRECT never reads from the page cache
                            best["read warm"] = min(best["read warm"], _run(path, size, chunk, threads, False, "read"))
                    except OSError as e:
                        if direct:
                            raise SystemExit(f"O_DIRECT is not supported on {args.dir} ({e}).") from e
                        raise
                    finally:
                        path.unlink(missing_ok=True)
                row = {"mode": "O_DIRECT" if direct else "page cache", "threads": threads}
                row.update({f"{k} GB/s": round(size / v / 1e9, 3) if v != float("inf") else None
                            for k, v in best.items()})
                rows.append(row)
                print(row, flush=True)
    finally:
        path.unlink(missing_ok=True)
    meta = {"dir": args.dir, "filesystem": _filesystem(Path(args.dir)), "size": size, "chunk": chunk,
            "repeat": args.repeat, "cpus": os.cpu_count(), "machine": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Swap-file I/O on {meta['filesystem']} ({meta['date']})", "",
             f"{size / 2**30:.1f} GiB file, {chunk / 2**20:.0f} MiB pieces, fastest of {args.repeat};"
             " write includes fsync; cold reads after posix_fadvise(DONTNEED).", "",
             "| mode | threads | write GB/s | read cold GB/s | read warm GB/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['threads']} | {r['write GB/s']} | {r['read cold GB/s']} |"
                     f" {r['read warm GB/s'] if r['read warm GB/s'] is not None else '-'} |")
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
