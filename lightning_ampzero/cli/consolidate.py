"""``ampzero-consolidate CKPT OUT``: a sharded checkpoint -> plain state-dict file(s), no GPU, no process group."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def _status_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _start_peak_window() -> int:
    """Reset the peak-RSS mark to the current RSS (Linux) and return the current RSS in bytes.

    The lifetime peak (ru_maxrss) is dominated by importing torch, which would hide what
    consolidation itself costs; writing 5 to clear_refs restarts the high-water mark.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    rss = _status_kib("VmRSS")
    return rss * 1024 if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int:
    hwm = _status_kib("VmHWM")
    return hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Optional[Sequence[str]] = None) -> int:
    from lightning_ampzero.checkpoint.consolidate import DTYPES, FORMATS

    parser = argparse.ArgumentParser(
        prog="ampzero-consolidate",
        description="Stream a sharded lightning_ampzero checkpoint into a state dict that loads into the plain"
        " model with load_state_dict. Memory is bounded by the largest tensor (or --max-shard-size for --format pt).",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (e.g. 'epoch=3-step=400.ckpt')")
    parser.add_argument("out", type=Path, help="output file, or folder when the output is split into shards")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: keep)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    parser.add_argument("--max-shard-size", default=None, help="split output files, e.g. 5GB (default: one file)")
    parser.add_argument("--strip-prefix", default="",
                        help="keep only keys under this prefix and drop it, e.g. 'model.' for the inner nn.Module")
    args = parser.parse_args(argv)

    import torch  # noqa: F401  (imported before measuring, so the baseline includes it)
    from rich.console import Console
    from rich.table import Table

    from lightning_ampzero.checkpoint.consolidate import consolidate_checkpoint, load_consolidated

    console = Console(stderr=True)
    baseline = _start_peak_window()
    start = time.perf_counter()
    try:
        paths = consolidate_checkpoint(args.checkpoint, args.out, dtype=args.dtype, fmt=args.format,
                                       max_shard_size=args.max_shard_size, strip_prefix=args.strip_prefix)
    except (ValueError, FileNotFoundError, TypeError) as err:
        console.print(f"[red]ampzero-consolidate: {err}[/red]")
        return 2
    elapsed = time.perf_counter() - start
    peak = _peak_rss_bytes() - baseline
    size = sum(p.stat().st_size for p in paths)
    table = Table(title="ampzero-consolidate")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("files", "\n".join(str(p) for p in paths))
    table.add_row("bytes written", f"{size / 2**20:,.1f} MiB")
    table.add_row("peak memory above start", f"{peak / 2**20:,.1f} MiB")
    table.add_row("time", f"{elapsed:.1f} s")
    console.print(table)
    # machine-readable last line for scripts and tests
    print(f"consolidated files={len(paths)} bytes={size} peak_rss_increase={peak} seconds={elapsed:.3f}")
    del load_consolidated
    return 0


if __name__ == "__main__":
    sys.exit(main())
