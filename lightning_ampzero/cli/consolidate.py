"""``ampzero-consolidate CKPT OUT``: a sharded checkpoint -> plain state-dict file(s), no GPU, no process group.

With ``--format lightning`` OUT is one Lightning checkpoint file (weights, hyper-parameters and loop
state; no optimizer states) that ``LightningModule.load_from_checkpoint(OUT)`` loads.

With ``--hf-config DIR`` OUT is a Hugging Face ``save_pretrained`` directory instead (config.json,
HF key names, tied copies dropped) that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.
"""

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
    parser.add_argument("--format", choices=(*FORMATS, "lightning"), default=None,
                        help="safetensors or pt: a state dict; lightning: one .ckpt file that"
                             " LightningModule.load_from_checkpoint loads (weights and hyper-parameters, no optimizer)."
                             " Default: what OUT's suffix names (.pt, .pth, .bin: pt), else safetensors")
    parser.add_argument("--max-shard-size", default=None,
                        help="split output files, e.g. 5GB (default: one file; with --hf-config: 5GB)")
    parser.add_argument("--strip-prefix", default=None,
                        help="keep only keys under this prefix and drop it, e.g. 'model.' for the inner nn.Module"
                        " (with --hf-config: found from the model's names when not given)")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="write a Hugging Face save_pretrained directory: a directory with the model's config.json"
                        " (e.g. the one the model was loaded from)")
    parser.add_argument("--hf-class", default=None,
                        help="with --hf-config: the transformers model class (default: the config's architectures[0])")
    args = parser.parse_args(argv)
    if args.hf_class and args.hf_config is None:
        parser.error("--hf-class needs --hf-config")
    if args.hf_config is not None and args.format not in (None, "safetensors"):
        parser.error("--hf-config writes safetensors: leave --format at its default")
    if args.format == "lightning" and (args.max_shard_size is not None or args.strip_prefix is not None):
        parser.error("--format lightning writes one file with the LightningModule's own keys: drop --max-shard-size"
                     " and --strip-prefix")

    import torch  # noqa: F401  (imported before measuring, so the baseline includes it)
    import torch.distributed.checkpoint  # noqa: F401  (likewise: the reader, about 50 MiB of modules)
    if args.hf_config is not None:
        try:
            import transformers  # noqa: F401  (likewise: its import is not what the export costs)
        except ImportError:
            print("ampzero-consolidate: --hf-config needs transformers (pip install transformers).", file=sys.stderr)
            return 2
        from lightning_ampzero.hf.export import meta_model

        try:  # transformers imports the model's module on first use: 180 MiB counted as the export's cost
            meta_model(args.hf_config, args.hf_class)
        except Exception:  # noqa: BLE001 - the export below says what is wrong, in its own words
            pass
    from rich.console import Console
    from rich.table import Table

    from lightning_ampzero.estimate import format_bytes

    from lightning_ampzero.checkpoint.consolidate import (
        consolidate_checkpoint,
        consolidate_to_lightning,
        load_consolidated,
    )

    console = Console(stderr=True)
    baseline = _start_peak_window()
    start = time.perf_counter()
    try:
        if args.hf_config is not None:
            from lightning_ampzero.hf.export import DEFAULT_MAX_SHARD_SIZE, export_checkpoint

            paths = export_checkpoint(args.checkpoint, args.out, args.hf_config, prefix=args.strip_prefix,
                                      model_class=args.hf_class, dtype=args.dtype,
                                      max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        elif args.format == "lightning":
            paths = consolidate_to_lightning(args.checkpoint, args.out, dtype=args.dtype)
        else:
            paths = consolidate_checkpoint(args.checkpoint, args.out, dtype=args.dtype, fmt=args.format,
                                           max_shard_size=args.max_shard_size, strip_prefix=args.strip_prefix or "")
    except (ValueError, FileNotFoundError, TypeError, NotImplementedError, ImportError) as err:
        # Plain print: rich would wrap the message at the terminal's width, into the middle of a path.
        print(f"ampzero-consolidate: error: {err}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    peak = _peak_rss_bytes() - baseline
    size = sum(p.stat().st_size for p in paths)
    table = Table(title="ampzero-consolidate")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("files", "\n".join(str(p) for p in paths))
    table.add_row("bytes written", format_bytes(size))
    table.add_row("peak memory above start", f"{peak / 2**20:,.1f} MiB")
    table.add_row("time", f"{elapsed:.1f} s")
    console.print(table)
    # machine-readable last line for scripts and tests
    print(f"consolidated files={len(paths)} bytes={size} peak_rss_increase={peak} seconds={elapsed:.3f}")
    del load_consolidated
    return 0


if __name__ == "__main__":
    sys.exit(main())
