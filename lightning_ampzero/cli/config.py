"""``ampzero-config``: config tools.

``ampzero-config from-deepspeed ds_config.json`` prints the ``ampzero-train`` command line
equivalent to a DeepSpeed config; ``--yaml`` prints an experiment file instead, to save as
``<config dir>/experiment/<name>.yaml`` and run with
``ampzero-train --config-dir <config dir> experiment=<name>``. Keys with no effect here are
listed on stderr, and so are keys read differently from DeepSpeed (notes: e.g. the
``activation_checkpointing`` section turns on full checkpointing); unknown keys fail with a
suggestion (exit status 2). Offload settings come out as ``offload.*`` overrides, activation
checkpointing and FP8 (``msamp``) as their groups (``activation_checkpointing=full``,
``fp8=tensorwise``) plus the values that differ from the option file.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampzero-config", description="lightning_ampzero config tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    ds = sub.add_parser(
        "from-deepspeed",
        help="convert a DeepSpeed JSON config to ampzero-train overrides or an experiment YAML",
        description="Convert a DeepSpeed JSON config to ampzero-train overrides (default) or an experiment YAML.",
    )
    ds.add_argument("path", help="the DeepSpeed config (JSON)")
    ds.add_argument("--yaml", action="store_true", help="print an experiment YAML instead of overrides")
    ds.add_argument("--name", default="deepspeed", help="experiment name used in the YAML's comments")
    ds.add_argument("--world-size", type=_positive_int, default=None,
                    help="processes in total (trainer.devices x trainer.num_nodes), to derive the accumulation or"
                         " data.batch_size from train_batch_size (default: ampzero-train's"
                         f" {DEFAULT_WORLD_SIZE} processes)")
    return parser


#: ampzero-train's processes when nothing says otherwise (hydra_schema.TrainerConfig: devices=2, one node).
DEFAULT_WORLD_SIZE = 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "from-deepspeed":
        return _from_deepspeed(args)
    return 2  # pragma: no cover - argparse rejects other commands


def _from_deepspeed(args: argparse.Namespace) -> int:
    from lightning_ampzero.deepspeed import DeepSpeedConfigError, convert_deepspeed_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # listed below, one line per key
            imported = convert_deepspeed_config(args.path, warn=False)
        world = args.world_size
        if world is None and imported.train_batch_size is not None:
            # The global batch depends on the processes; without them train_batch_size was dropped,
            # silently, and the run trained a smaller batch (a new-user trial: 4 sequences for 16).
            world = DEFAULT_WORLD_SIZE
            print(f"ampzero-config: note: train_batch_size={imported.train_batch_size}: derived for ampzero-train's"
                  f" default {world} processes (trainer.devices={world}); pass --world-size N for another count.",
                  file=sys.stderr)
        if args.yaml:
            text = imported.hydra_yaml(args.name, world_size=world)
        else:
            text = "ampzero-train " + " ".join(shlex.quote(o) for o in imported.hydra_overrides(world))
    except (DeepSpeedConfigError, FileNotFoundError) as e:
        print(f"ampzero-config: error: {e}", file=sys.stderr)
        return 2
    for key, reason in imported.no_effect:
        print(f"ampzero-config: no effect: {key}: {reason}", file=sys.stderr)
    for key, reason in imported.notes:
        print(f"ampzero-config: note: {key}: {reason}", file=sys.stderr)
    if imported.auto:  # one line for them all (it was repeated per key: a trial counted 12)
        print(f"ampzero-config: \"auto\" ({', '.join(imported.auto)}): ampzero-train's defaults here; with"
              " AmpZeroStrategy(config=...) in a script, the Trainer's, DataLoader's or LightningModule's own"
              " settings (an optimizer's lr: the module's)", file=sys.stderr)
    scaler = imported.fp16_auto_loss_scaler
    if scaler is not None:  # fp16 "auto": the section's scaler applies only under an fp16 precision
        changed = [f"precision.loss_scaler.{name}={value}" for name, value in scaler.non_default().items()]
        print("ampzero-config: note: fp16.enabled is \"auto\": with precision=16-mixed (or 16-true) add"
              f" {' '.join(changed) or 'nothing (its values are the defaults)'} for the section's loss scaler",
              file=sys.stderr)
    print(text.rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
