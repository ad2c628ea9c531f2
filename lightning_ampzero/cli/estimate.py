"""``ampzero-estimate``: model-state and activation memory per GPU / per node, and the ``plan`` subcommand.

Examples::

    ampzero-estimate --params 7e9 --largest-layer 2.6e8 --gpus-per-node 8 --nodes 1
    ampzero-estimate --model gpt --n-layer 24 --n-embd 2048 --n-head 16 --vocab-size 50304 \\
        --block-size 2048 --micro-batch 8 --gpus-per-node 8
    ampzero-estimate plan --model gpt --n-layer 24 --n-embd 2048 --n-head 16 --vocab-size 50304 \\
        --block-size 2048 --micro-batch 8 --gpus-per-node 8 --gpu-memory 80GB --cpu-memory 512GB

Sizes take units (``80GB`` = 80·10^9 bytes, ``80GiB`` = 80·2^30); counts take ``7e9``, ``1.3B``,
``350M``. See docs/estimator.md for what every figure counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from lightning_ampzero.config import STAGES, ZeroConfig
from lightning_ampzero.estimate import (
    CHECKPOINTING,
    OFFLOADS,
    OPTIMIZERS,
    PLAN_ORDER,
    PRECISIONS,
    ActivationTrace,
    ModelSize,
    Plan,
    estimate_all,
    format_bytes,
    format_count,
    gpt_activations,
    gpt_size,
    parse_bytes,
    parse_count,
    plan,
)

MODELS = ("gpt",)


def _count(what: str):
    def parse(text: str) -> int:
        try:
            return parse_count(text, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _size(what: str):
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _positive_int(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number >= 1, got {text!r}.") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number >= 1, got {text!r}.")
        return value
    return parse


def _fraction(what: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a fraction in [0, 1), got {text!r}.") from None
        if not 0 <= value < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a fraction in [0, 1), got {text!r}.")
        return value
    return parse


def _choices(what: str, allowed: Sequence[Any], convert=str):
    def parse(text: str) -> tuple:
        out = []
        for item in (t.strip() for t in text.split(",")):
            try:
                value = convert(item)
            except ValueError:
                value = None
            if value not in allowed:
                raise argparse.ArgumentTypeError(
                    f"{what}: {item!r} is not valid. Allowed values: {', '.join(map(str, allowed))}"
                    " (comma-separated)."
                )
            out.append(value)
        return tuple(dict.fromkeys(out))
    return parse


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"--cpu-factor must be a number >= 1, got {text!r}.")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model (give --params or --model)")
    src.add_argument("--params", type=_count("--params"), help="parameter count Ψ, e.g. 7e9, 1.3B, 350M")
    src.add_argument("--largest-layer", type=_count("--largest-layer"),
                     help="parameters of the largest layer (DeepSpeed's L); needed with --params")
    src.add_argument("--largest-unit", type=_count("--largest-unit"),
                     help="with --params: parameters of the largest FSDP2 unit (a transformer block);"
                          " default --largest-layer")
    src.add_argument("--model", choices=MODELS, help="build this model on the meta device and count it")
    src.add_argument("--n-layer", type=_positive_int("--n-layer"), default=4)
    src.add_argument("--n-embd", type=_positive_int("--n-embd"), default=128)
    src.add_argument("--n-head", type=_positive_int("--n-head"), default=4)
    src.add_argument("--vocab-size", type=_positive_int("--vocab-size"), default=256)
    src.add_argument("--block-size", type=_positive_int("--block-size"), default=64, help="model's maximum sequence length")
    act = p.add_argument_group("activations (with --model)")
    act.add_argument("--micro-batch", type=_positive_int("--micro-batch"), default=1, help="sequences per GPU per step")
    act.add_argument("--seq-len", type=_positive_int("--seq-len"), help="tokens per sequence (default --block-size)")
    hw = p.add_argument_group("hardware and training")
    hw.add_argument("--gpus-per-node", type=_positive_int("--gpus-per-node"), default=1)
    hw.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    hw.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16-mixed")
    hw.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    hw.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                    help="ZeroConfig field used to group units (e.g. prefetch_bucket_size=0); repeatable")
    ds = p.add_argument_group("DeepSpeed estimator options")
    ds.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=True,
                    help="the model is built partitioned / on the device (DeepSpeed zero.Init; Lightning's"
                         " configure_model()); --no-zero-init: built whole on each process's CPU first. Default on")
    ds.add_argument("--cpu-factor", type=_factor, default=1.5,
                    help="DeepSpeed's additional_buffer_factor on its CPU figures (default 1.5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def build_parser(command: str) -> argparse.ArgumentParser:
    if command == "plan":
        p = argparse.ArgumentParser(
            prog="ampzero-estimate plan",
            description="The fastest configuration that fits the memory given: " + PLAN_ORDER + ".",
        )
        _common(p)
        b = p.add_argument_group("budget")
        b.add_argument("--gpu-memory", type=_size("--gpu-memory"), required=True, help="per GPU, e.g. 80GB or 79.6GiB")
        b.add_argument("--cpu-memory", type=_size("--cpu-memory"), required=True, help="per node, e.g. 512GB")
        b.add_argument("--nvme-memory", type=_size("--nvme-memory"), help="free NVMe per node (default: no NVMe)")
        b.add_argument("--gpu-headroom", type=_fraction("--gpu-headroom"), default=0.1,
                       help="fraction of GPU memory kept free (allocator, communication buffers, CUDA context);"
                            " default 0.1")
        b.add_argument("--cpu-headroom", type=_fraction("--cpu-headroom"), default=0.1,
                       help="fraction of CPU memory kept free; default 0.1")
        s = p.add_argument_group("search space")
        s.add_argument("--stages", type=_choices("--stages", STAGES, int), default=STAGES)
        s.add_argument("--offload", type=_choices("--offload", OFFLOADS), default=OFFLOADS)
        s.add_argument("--checkpointing", type=_choices("--checkpointing", CHECKPOINTING), default=CHECKPOINTING)
        s.add_argument("--show", type=int, default=2, help="fitting alternatives shown after the choice (default 2)")
        return p
    p = argparse.ArgumentParser(
        prog="ampzero-estimate",
        description="Model-state memory per GPU and per node for every ZeRO stage and offload option (ours and"
                    " DeepSpeed's estimator), and activations traced on the meta device. Subcommand:"
                    " `ampzero-estimate plan --gpu-memory 80GB --cpu-memory 512GB ...` picks the fastest"
                    " configuration that fits.",
    )
    _common(p)
    p.add_argument("--checkpointing", type=_choices("--checkpointing", CHECKPOINTING), default=CHECKPOINTING,
                   help="activation checkpointing settings to show (default: none,full)")
    return p


def _zero(args: argparse.Namespace, p: argparse.ArgumentParser) -> ZeroConfig:
    data: dict[str, Any] = {}
    for item in args.zero:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--zero expects KEY=VALUE, got {item!r}.")
        try:
            data[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            data[key.strip()] = value
    data.pop("stage", None)
    try:
        return ZeroConfig.from_dict(data)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    raise AssertionError  # unreachable: p.error exits


def _model(args: argparse.Namespace, p: argparse.ArgumentParser, zero: ZeroConfig) -> tuple[ModelSize, Optional[ActivationTrace]]:
    if (args.params is None) == (args.model is None):
        p.error("give the model either as counts (--params 7e9 --largest-layer 2.6e8) or as --model gpt with its"
                " sizes (--n-layer, --n-embd, ...), not both.")
    try:
        if args.params is not None:
            if args.largest_layer is None:
                p.error("--params needs --largest-layer (parameters of the biggest single layer, e.g. the embedding"
                        " or an MLP projection): ZeRO-3 gathers a whole layer at a time.")
            size = ModelSize(args.params, args.largest_layer, unit=args.largest_unit or 0,
                             description=f"{format_count(args.params)} model (given counts)")
            return size, None
        if args.largest_layer is not None or args.largest_unit is not None:
            p.error("--largest-layer / --largest-unit go with --params; --model finds them in the model.")
        from lightning_ampzero.models.config import GPTConfig

        cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                        n_head=args.n_head, n_embd=args.n_embd)
        seq = args.seq_len if args.seq_len is not None else cfg.block_size
        return gpt_size(cfg, zero), gpt_activations(cfg, args.micro_batch, seq, args.precision)
    except ValueError as e:
        p.error(str(e))
    raise AssertionError


def _console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


def _header(size: ModelSize, args: argparse.Namespace) -> str:
    n = args.gpus_per_node * args.nodes
    unit = f", largest unit {size.largest_unit:,}" if size.units or size.unit else ""
    return (f"{size.description}: {size.numel:,} parameters, largest layer {size.largest_layer:,}{unit}; "
            f"{args.nodes} node(s) x {args.gpus_per_node} GPU(s) = {n} rank(s); {args.precision}, {args.optimizer}")


def _estimate(argv: Sequence[str]) -> int:
    p = build_parser("estimate")
    args = p.parse_args(argv)
    zero = _zero(args, p)
    size, acts = _model(args, p, zero)
    kw = dict(gpus_per_node=args.gpus_per_node, nodes=args.nodes, precision=args.precision, optimizer=args.optimizer,
              zero=zero, zero_init=args.zero_init, additional_buffer_factor=args.cpu_factor)
    try:
        rows = estimate_all(size, **kw)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps({"model": {"numel": size.numel, "largest_layer": size.largest_layer,
                                    "largest_unit": size.largest_unit, "description": size.description},
                          "model_states": [r.as_dict() for r in rows],
                          "activations": ({c: acts.bytes(c) for c in args.checkpointing} if acts else None)}, indent=1))
        return 0
    from rich.table import Table

    console = _console()
    console.print(_header(size, args))
    t = Table(title="Model states (ours: FSDP2 accounting; DeepSpeed: its estimator, fp16 + Adam)", title_justify="left")
    for col in ("stage", "offload", "GPU params", "GPU grads", "GPU optim", "GPU working", "GPU total",
                "CPU / node", "NVMe / node", "DeepSpeed GPU", f"DeepSpeed CPU (zero_init={int(args.zero_init)})"):
        t.add_column(col, justify="left" if col in ("stage", "offload") else "right", no_wrap=col == "offload")
    for r in rows:
        t.add_row(str(r.stage), r.offload, format_bytes(r.gpu_params), format_bytes(r.gpu_grads),
                  format_bytes(r.gpu_optimizer), format_bytes(r.gpu_working), format_bytes(r.gpu),
                  format_bytes(r.cpu), format_bytes(r.nvme) if r.nvme else "-",
                  format_bytes(r.deepspeed_gpu), format_bytes(r.deepspeed_cpu))
    console.print(t)
    if acts is not None:
        seq = args.seq_len if args.seq_len is not None else args.block_size
        a = Table(title=f"Activations per GPU (micro-batch {args.micro_batch} x {seq} tokens, traced on the meta device)",
                  title_justify="left")
        for col in ("checkpointing", "saved for backward", "what is kept"):
            a.add_column(col, justify="right" if col == "saved for backward" else "left")
        what = {"none": "everything the forward saves",
                "full": "block inputs + outside blocks + one block recomputed"}
        for c in args.checkpointing:
            a.add_row(c, format_bytes(acts.bytes(c)), what[c])
        console.print(a)
    else:
        console.print("Activations: not estimated from counts; use --model to trace them on the meta device.")
    console.print("GPU = per GPU; CPU and NVMe = per node. Working = gathered parameters and unsharded gradients of the"
                  " units in use (stages 2-3), DDP gradient buckets (stage 0). DeepSpeed has no estimator for stages"
                  " 0-1 or NVMe ('-').")
    return 0


def _plan(argv: Sequence[str]) -> int:
    p = build_parser("plan")
    args = p.parse_args(argv)
    if args.show < 0:
        p.error(f"--show must be >= 0, got {args.show}.")
    zero = _zero(args, p)
    size, acts = _model(args, p, zero)
    try:
        result = plan(size, args.gpu_memory, args.cpu_memory, nvme_memory=args.nvme_memory, activations=acts,
                      stages=args.stages, offloads=args.offload, checkpointing=args.checkpointing,
                      gpu_headroom=args.gpu_headroom, cpu_headroom=args.cpu_headroom,
                      gpus_per_node=args.gpus_per_node, nodes=args.nodes, precision=args.precision,
                      optimizer=args.optimizer, zero=zero, zero_init=args.zero_init,
                      additional_buffer_factor=args.cpu_factor)
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
        return 0 if result.choice else 1
    render_plan(result, size, args)
    return 0 if result.choice else 1


def render_plan(result: Plan, size: ModelSize, args: argparse.Namespace, console: Any = None) -> None:
    from rich.table import Table

    console = console or _console()
    console.print(_header(size, args))
    nvme = f", NVMe {format_bytes(result.nvme_budget)}" if result.nvme_budget is not None else ""
    console.print(f"Budget: GPU {format_bytes(result.gpu_budget)} per GPU (after {args.gpu_headroom:.0%} headroom),"
                  f" CPU {format_bytes(result.cpu_budget)} per node (after {args.cpu_headroom:.0%}){nvme}."
                  f" Preference: {PLAN_ORDER}.")
    if not result.activations_known:
        console.print("[yellow]Activations not included (counts given): use --model to trace them.[/yellow]")
    t = Table(title="ampzero-estimate plan", title_justify="left")
    for col in ("#", "stage", "offload", "checkpointing", "GPU need", "CPU / node", "NVMe / node", "verdict"):
        t.add_column(col, justify="right" if col in ("#", "GPU need", "CPU / node", "NVMe / node") else "left",
                     no_wrap=col == "offload")
    choice = result.choice
    shown_after = 0
    for i, c in enumerate(result.candidates, 1):
        if choice is not None and result.candidates.index(choice) < i - 1:
            if not c.fits or shown_after >= args.show:
                continue
            shown_after += 1
            verdict, style = "fits; slower (later in the preference order)", "dim"
        elif c is choice:
            verdict, style = "CHOSEN: the fastest that fits", "bold green"
        else:
            verdict, style = "rejected: " + "; ".join(c.reasons), "red"
        t.add_row(str(i), str(c.stage), c.offload, c.checkpointing, format_bytes(c.gpu), format_bytes(c.cpu),
                  format_bytes(c.nvme) if c.nvme else "-", verdict, style=style)
    console.print(t)
    if choice is None:
        smallest = min(result.candidates, key=lambda c: c.gpu)
        console.print(f"[bold red]Nothing fits.[/bold red] The smallest GPU need is {format_bytes(smallest.gpu)}"
                      f" ({smallest.name}). Try more GPUs (--gpus-per-node / --nodes), a smaller micro-batch,"
                      " --nvme-memory, or a wider --offload / --checkpointing search.")
        return
    overrides = f"stage={choice.stage}"
    console.print(f"Chosen: {choice.name}. Strategy: AmpZeroStrategy({overrides})"
                  + ("" if choice.offload == "none" else f", offload {choice.offload}")
                  + ("" if choice.checkpointing == "none" else ", activation checkpointing of every block") + ".")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        return _plan(argv[1:])
    return _estimate(argv)


if __name__ == "__main__":
    sys.exit(main())
