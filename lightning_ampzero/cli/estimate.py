"""``ampzero-estimate``: model-state and activation memory per GPU / per node, and the ``plan`` subcommand.

Examples::

    ampzero-estimate --params 7e9 --largest-layer 2.6e8 --gpus-per-node 8 --nodes 1
    ampzero-estimate --model gpt --n-layer 24 --n-embd 2048 --n-head 16 --vocab-size 50304 \\
        --block-size 2048 --micro-batch 8 --gpus-per-node 8
    ampzero-estimate plan --model gpt --n-layer 24 --n-embd 2048 --n-head 16 --vocab-size 50304 \\
        --block-size 2048 --micro-batch 8 --gpus-per-node 8 --gpu-memory 80GB --cpu-memory 512GB
    ampzero-estimate plan --model gpt --n-layer 32 --n-embd 2560 --n-head 20 --accelerator cpu \\
        --gpus-per-node 2 --cpu-memory 24GiB --nvme-memory 200GB --nvme-bandwidth 2.5GB \\
        --zero allgather_bucket_size=78676480 --zero reduce_bucket_size=78676480 --zero prefetch_bucket_size=78676480

Sizes take units (``80GB`` = 80·10^9 bytes, ``80GiB`` = 80·2^30); counts take ``7e9``, ``1.3B``,
``350M``. See docs/estimator.md for what every figure counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

import torch

from lightning_ampzero.config import STAGES, OffloadConfig, ZeroConfig
from lightning_ampzero.estimate import (
    ACTIVATION_DTYPES,
    CHECKPOINTING,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    ActivationTrace,
    Estimate,
    ModelSize,
    estimate_all,
    format_bytes,
    format_count,
    gpt_activations,
    gpt_size,
    model_size,
    parse_bytes,
    parse_count,
    trace_activations,
)
from lightning_ampzero.planner import ACCELERATORS, PLAN_ORDER, Plan, host_on_cpu, plan

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


def _rate(what: str):
    def parse(text: str) -> int:
        size = text.strip()
        size = size[:-2] if size.lower().endswith("/s") else size
        try:
            value = parse_bytes(size, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (bytes per second; '/s' may follow)") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be > 0 bytes per second, got {text!r}.")
        return value
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
    src = p.add_argument_group("model (give --params, --model or --hf-config)")
    src.add_argument("--params", type=_count("--params"), help="parameter count Ψ, e.g. 7e9, 1.3B, 350M")
    src.add_argument("--largest-layer", type=_count("--largest-layer"),
                     help="parameters of the largest layer (DeepSpeed's L); needed with --params")
    src.add_argument("--largest-unit", type=_count("--largest-unit"),
                     help="with --params: parameters of the largest FSDP2 unit at stage 3, which is as many"
                          " consecutive blocks as zero.reduce_bucket_size holds (all of them at the default"
                          " 5e8), not one block; default --largest-layer. --model or --hf-config finds the units")
    src.add_argument("--model", choices=MODELS, help="build this model on the meta device and count it")
    src.add_argument("--hf-config", metavar="DIR", help="a Hugging Face model directory (or its config.json), local:"
                     " build that model on the meta device and count it; activations are traced with"
                     " input_ids and labels of --micro-batch x --seq-len tokens")
    src.add_argument("--hf-class", metavar="NAME",
                     help="with --hf-config: the transformers class (default: the config's architectures[0])")
    src.add_argument("--n-layer", type=_positive_int("--n-layer"), default=4)
    src.add_argument("--n-embd", type=_positive_int("--n-embd"), default=128)
    src.add_argument("--n-head", type=_positive_int("--n-head"), default=4)
    src.add_argument("--vocab-size", type=_positive_int("--vocab-size"), default=256)
    src.add_argument("--block-size", type=_positive_int("--block-size"), default=64, help="model's maximum sequence length")
    act = p.add_argument_group("activations (with --model)")
    act.add_argument("--micro-batch", type=_positive_int("--micro-batch"), default=1, help="sequences per GPU per step")
    act.add_argument("--seq-len", type=_positive_int("--seq-len"), help="tokens per sequence (default --block-size)")
    hw = p.add_argument_group("hardware and training")
    hw.add_argument("--accelerator", choices=ACCELERATORS, default="gpu",
                    help="cpu: no GPU, ranks are CPU processes and every figure is host memory (default gpu)")
    hw.add_argument("--gpus-per-node", type=_positive_int("--gpus-per-node"), default=1,
                    help="ranks per node (CPU processes with --accelerator cpu)")
    hw.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    hw.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16-mixed")
    hw.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    hw.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                    help="ZeroConfig field used to group units (e.g. prefetch_bucket_size=0); repeatable")
    hw.add_argument("--offload-config", action="append", default=[], metavar="KEY=VALUE",
                    help="OffloadConfig field of the NVMe options (sub_group_size, buffer_count, param_buffer_count,"
                         " param_buffer_size: buffers counted in host memory; offload_grad); repeatable; default"
                         " OffloadConfig's")
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
        b.add_argument("--gpu-memory", type=_size("--gpu-memory"),
                       help="per GPU, e.g. 80GB or 79.6GiB (required unless --accelerator cpu)")
        b.add_argument("--cpu-memory", type=_size("--cpu-memory"), required=True, help="per node, e.g. 512GB")
        b.add_argument("--nvme-memory", type=_size("--nvme-memory"), help="free NVMe per node (default: no NVMe)")
        b.add_argument("--nvme-bandwidth", type=_rate("--nvme-bandwidth"),
                       help="read bandwidth of a node's drive per second, e.g. 2.5GB (benchmarks/bench_nvme_io.py"
                            " measures it): prints each NVMe option's I/O seconds per step")
        b.add_argument("--nvme-write-bandwidth", type=_rate("--nvme-write-bandwidth"),
                       help="write bandwidth, if it differs from --nvme-bandwidth")
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


def _buffers(args: argparse.Namespace, p: argparse.ArgumentParser) -> OffloadConfig:
    """The NVMe swap buffers' sizes (OffloadConfig's defaults unless --offload-config says otherwise)."""
    data: dict[str, Any] = {}
    for item in args.offload_config:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--offload-config expects KEY=VALUE, got {item!r}.")
        try:
            data[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            data[key.strip()] = value
    for where in ("offload_optimizer", "offload_param", "nvme_path"):
        if data.pop(where, None) is not None:
            p.error(f"--offload-config {where}=... is not an option here: --offload (plan) searches where states go.")
    try:
        return OffloadConfig.from_dict({**data, "offload_optimizer": "nvme", "offload_param": "nvme"})
    except (ValueError, TypeError) as e:
        p.error(str(e))
    raise AssertionError


def _model(args: argparse.Namespace, p: argparse.ArgumentParser, zero: ZeroConfig) -> tuple[ModelSize, Optional[ActivationTrace]]:
    given = [a for a in ("params", "model", "hf_config") if getattr(args, a) is not None]
    if len(given) != 1:
        p.error("give the model one way: as counts (--params 7e9 --largest-layer 2.6e8), as --model gpt with its"
                " sizes (--n-layer, --n-embd, ...), or as --hf-config DIR (a Hugging Face model directory).")
    if args.hf_class is not None and args.hf_config is None:
        p.error("--hf-class goes with --hf-config.")
    try:
        if args.hf_config is not None:
            return _hf_model(args, p, zero)
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


def _hf_model(args: argparse.Namespace, p: argparse.ArgumentParser,
              zero: ZeroConfig) -> tuple[ModelSize, Optional[ActivationTrace]]:
    """--hf-config: the model on the meta device; activations of a step with ``labels`` when its forward takes them."""
    try:
        from lightning_ampzero.hf.export import meta_model
    except ImportError:  # transformers is not a dependency of the package
        p.error("--hf-config needs transformers: pip install transformers.")
    if args.largest_layer is not None or args.largest_unit is not None:
        p.error("--largest-layer / --largest-unit go with --params; --hf-config finds them in the model.")
    model = meta_model(args.hf_config, args.hf_class)
    size = model_size(model, zero, f"{type(model).__name__} ({args.hf_config})")
    if args.seq_len is None:
        args.seq_len = args.block_size
    ids = torch.zeros(args.micro_batch, args.seq_len, dtype=torch.long, device="meta")
    # Traced in the precision's 16-bit dtype, as gpt_activations does: the trace counted fp32 under
    # every precision (a new-user trial: bf16-mixed measured 540 KiB against 908 KiB estimated).
    model = model.to(ACTIVATION_DTYPES[args.precision])
    try:
        acts = trace_activations(model, lambda m: m(input_ids=ids, labels=ids).loss)
    except (TypeError, ValueError, AttributeError) as e:  # no labels / no loss: a base model without a head
        args.no_activations = (f"Activations: not traced: {type(model).__name__}(input_ids, labels) gives no loss"
                               f" ({type(e).__name__}: {str(e).splitlines()[0][:120]}). Pass --hf-class with a"
                               " class that has a head, e.g. ...ForCausalLM.")
        return size, None
    return size, acts


def _console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


def _header(size: ModelSize, args: argparse.Namespace) -> str:
    n = args.gpus_per_node * args.nodes
    unit = f", largest unit {size.largest_unit:,}" if size.units or size.unit else ""
    device = "GPU(s)" if args.accelerator == "gpu" else "CPU rank(s), no GPU"
    return (f"{size.description}: {size.numel:,} parameters, largest layer {size.largest_layer:,}{unit}; "
            f"{args.nodes} node(s) x {args.gpus_per_node} {device} = {n} rank(s); {args.precision}, {args.optimizer}")


NVME_CAPTION = (
    "Swap-file bytes per optimizer step with one micro-batch (lightning_ampzero.estimate.nvme_traffic): the"
    " optimizer's fp32 master and two moments are read and written once (12 bytes x params / ranks each way);"
    " with parameters on NVMe each unit's shard is also read for every all-gather (forward, and again in"
    " backward) and the updated shard written once. Per node: all its ranks, which share the drive. Gradient"
    " accumulation repeats the parameter reads per micro-batch.")


def _nvme_node(r: Estimate, args: argparse.Namespace) -> tuple[int, int]:
    return args.gpus_per_node * r.nvme_read, args.gpus_per_node * r.nvme_written


def _estimate(argv: Sequence[str]) -> int:
    p = build_parser("estimate")
    args = p.parse_args(argv)
    zero = _zero(args, p)
    buffers = _buffers(args, p)
    size, acts = _model(args, p, zero)
    kw = dict(gpus_per_node=args.gpus_per_node, nodes=args.nodes, precision=args.precision, optimizer=args.optimizer,
              zero=zero, zero_init=args.zero_init, additional_buffer_factor=args.cpu_factor, buffers=buffers,
              accelerator=args.accelerator)
    try:
        rows = estimate_all(size, **kw)
    except ValueError as e:
        p.error(str(e))
    on_cpu = args.accelerator == "cpu"
    hosts = [host_on_cpu(r, gpus_per_node=args.gpus_per_node) for r in rows] if on_cpu else None
    if args.json:
        states = []
        for i, r in enumerate(rows):
            read_node, written_node = _nvme_node(r, args)
            row = {**r.as_dict(), "nvme_read_node": read_node, "nvme_written_node": written_node}
            if hosts is not None:
                row["host_per_rank"], row["host_per_node"] = hosts[i]
            states.append(row)
        print(json.dumps({"model": {"numel": size.numel, "largest_layer": size.largest_layer,
                                    "largest_unit": size.largest_unit, "description": size.description},
                          "accelerator": args.accelerator, "model_states": states, "nvme_traffic": NVME_CAPTION,
                          "activations": ({c: acts.bytes(c) for c in args.checkpointing} if acts else None)}, indent=1))
        return 0
    from rich.table import Table

    console = _console()
    console.print(_header(size, args))
    title = ("Model states (FSDP2 accounting; no GPU: every column is host memory)" if on_cpu else
             "Model states (ours: FSDP2 accounting; DeepSpeed: its estimator, fp16 + Adam)")
    t = Table(title=title, title_justify="left")
    cols = ["stage", "offload", "GPU params", "GPU grads", "GPU optim", "GPU working", "GPU total",
            "CPU / node", "NVMe / node", "DeepSpeed GPU", f"DeepSpeed CPU (zero_init={int(args.zero_init)})"]
    if on_cpu:  # no GPU: a rank's own columns; DeepSpeed's estimator is for GPUs: its give way to host totals
        cols[2:7] = ["rank params", "rank grads", "rank optim", "rank working", "rank total"]
        cols[7:] = ["host / rank", "host / node", "offloaded / node", "NVMe / node"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("stage", "offload") else "right", no_wrap=col == "offload")
    for i, r in enumerate(rows):
        cells = [str(r.stage), r.offload, format_bytes(r.gpu_params), format_bytes(r.gpu_grads),
                 format_bytes(r.gpu_optimizer), format_bytes(r.gpu_working), format_bytes(r.gpu),
                 format_bytes(r.cpu), format_bytes(r.nvme) if r.nvme else "-",
                 format_bytes(r.deepspeed_gpu), format_bytes(r.deepspeed_cpu)]
        if hosts is not None:
            cells[7:] = [format_bytes(hosts[i][0]), format_bytes(hosts[i][1]), *cells[7:9]]
        t.add_row(*cells)
    console.print(t)
    n = Table(title="NVMe swap files, bytes per optimizer step", title_justify="left", caption=NVME_CAPTION,
              caption_justify="left")
    for col in ("stage", "offload", "NVMe / node", "read / rank", "written / rank", "read / node", "written / node"):
        n.add_column(col, justify="left" if col in ("stage", "offload") else "right", no_wrap=col == "offload")
    for r in rows:
        if r.nvme:
            read_node, written_node = _nvme_node(r, args)
            n.add_row(str(r.stage), r.offload, format_bytes(r.nvme), format_bytes(r.nvme_read),
                      format_bytes(r.nvme_written), format_bytes(read_node), format_bytes(written_node))
    console.print(n)
    if acts is not None:
        seq = args.seq_len if args.seq_len is not None else args.block_size
        per = "rank" if on_cpu else "GPU"
        a = Table(title=f"Activations per {per} (micro-batch {args.micro_batch} x {seq} tokens, traced on the meta"
                        " device)", title_justify="left")
        for col in ("checkpointing", "saved for backward", "what is kept"):
            a.add_column(col, justify="right" if col == "saved for backward" else "left")
        what = {"none": "everything the forward saves",
                "full": "block inputs + outside blocks + one block recomputed"}
        for c in args.checkpointing:
            a.add_row(c, format_bytes(acts.bytes(c)), what[c])
        console.print(a)
    else:
        console.print(getattr(args, "no_activations", "Activations: not estimated from counts; use --model or"
                                                         " --hf-config to trace them on the meta device."))
    if on_cpu:
        console.print("--accelerator cpu: rank = one CPU process's model states; offloaded = what the offload holds"
                      " in host memory per node (its tmpfs swap files and NVMe swap buffers included); host = rank"
                      " total + offloaded, each tensor counted once, activations not included (docs/estimator.md)."
                      " Working = gathered parameters and unsharded gradients of the units in use (stages 2-3), DDP"
                      " gradient buckets (stage 0). DeepSpeed's figures (for GPUs) are in --json.")
    else:
        console.print("GPU = per GPU; CPU and NVMe = per node. Working = gathered parameters and unsharded gradients"
                      " of the units in use (stages 2-3), DDP gradient buckets (stage 0). CPU includes the NVMe swap"
                      " buffers (--offload-config). DeepSpeed has no estimator for stages 0-1 or NVMe ('-').")
    return 0


def _plan(argv: Sequence[str]) -> int:
    p = build_parser("plan")
    args = p.parse_args(argv)
    if args.show < 0:
        p.error(f"--show must be >= 0, got {args.show}.")
    if args.accelerator == "gpu" and args.gpu_memory is None:
        p.error("--gpu-memory is required (per GPU, e.g. 80GB); on a machine without a GPU give --accelerator cpu,"
                " where --cpu-memory budgets everything.")
    if args.accelerator == "cpu" and args.gpu_memory is not None:
        p.error("--gpu-memory does not apply with --accelerator cpu: the ranks hold everything in host memory,"
                " which --cpu-memory budgets.")
    if args.nvme_write_bandwidth is not None and args.nvme_bandwidth is None:
        p.error("--nvme-write-bandwidth goes with --nvme-bandwidth (the read bandwidth).")
    bandwidth = None
    if args.nvme_bandwidth is not None:
        bandwidth = (args.nvme_bandwidth, args.nvme_write_bandwidth or args.nvme_bandwidth)
    zero = _zero(args, p)
    buffers = _buffers(args, p)
    size, acts = _model(args, p, zero)
    try:
        result = plan(size, args.gpu_memory, args.cpu_memory, nvme_memory=args.nvme_memory, nvme_bandwidth=bandwidth,
                      accelerator=args.accelerator, activations=acts,
                      stages=args.stages, offloads=args.offload, checkpointing=args.checkpointing,
                      gpu_headroom=args.gpu_headroom, cpu_headroom=args.cpu_headroom,
                      gpus_per_node=args.gpus_per_node, nodes=args.nodes, precision=args.precision,
                      optimizer=args.optimizer, zero=zero, zero_init=args.zero_init,
                      additional_buffer_factor=args.cpu_factor, buffers=buffers)
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
    on_cpu = result.accelerator == "cpu"
    console.print(_header(size, args))
    nvme = f", NVMe {format_bytes(result.nvme_budget)}" if result.nvme_budget is not None else ""
    if on_cpu:
        budget = (f"Budget (no GPU: model states, activations and offload share host memory): host"
                  f" {format_bytes(result.cpu_budget)} per node (after {args.cpu_headroom:.0%} headroom){nvme}.")
    else:
        budget = (f"Budget: GPU {format_bytes(result.gpu_budget)} per GPU (after {args.gpu_headroom:.0%} headroom),"
                  f" CPU {format_bytes(result.cpu_budget)} per node (after {args.cpu_headroom:.0%}){nvme}.")
    console.print(f"{budget} Preference: {PLAN_ORDER}.")
    if not result.activations_known:
        console.print("[yellow]Activations not included (counts given): use --model to trace them.[/yellow]")
    bw = result.nvme_bandwidth
    t = Table(title="ampzero-estimate plan", title_justify="left",
              caption="#: place in the preference order (fitting candidates after the chosen one beyond --show"
                      " are not listed). NVMe read / written: swap-file bytes per optimizer step and rank, one"
                      " micro-batch (estimate.nvme_traffic); "
                      + ("I/O s: the node's bytes (all its ranks share the drive) over the drive's bandwidth, a lower"
                         " bound on the step" if bw else "give --nvme-bandwidth for the I/O seconds per step"),
              caption_justify="left")
    cols = ["#", "stage", "offload", "checkpointing", "host / rank" if on_cpu else "GPU need",
            "host / node" if on_cpu else "CPU / node", "NVMe / node", "NVMe read / written"]
    if bw:
        cols.append("I/O s / step")
    cols.append("verdict")
    for col in cols:
        t.add_column(col, justify="left" if col in ("stage", "offload", "checkpointing", "verdict") else "right",
                     no_wrap=col in ("offload", "NVMe read / written"))
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
        io = f"{format_bytes(c.nvme_read)} / {format_bytes(c.nvme_written)}" if c.nvme else "-"
        cells = [str(i), str(c.stage), c.offload, c.checkpointing, format_bytes(c.host_per_rank if on_cpu else c.gpu),
                 format_bytes(c.cpu), format_bytes(c.nvme) if c.nvme else "-", io]
        if bw:
            cells.append(f"{c.io_seconds:,.1f}" if c.io_seconds is not None else "-")
        t.add_row(*cells, verdict, style=style)
    console.print(t)
    if choice is None:
        need = (lambda c: c.cpu) if on_cpu else (lambda c: c.gpu)
        smallest = min(result.candidates, key=need)
        what = "host need per node" if on_cpu else "GPU need"
        console.print(f"[bold red]Nothing fits.[/bold red] The smallest {what} is {format_bytes(need(smallest))}"
                      f" ({smallest.name}). Try more {'nodes' if on_cpu else 'GPUs (--gpus-per-node / --nodes)'},"
                      " a smaller micro-batch, --nvme-memory, a wider --offload / --checkpointing search, or smaller"
                      " stage-3 units (the working set: --zero allgather_bucket_size=N --zero reduce_bucket_size=N"
                      " --zero prefetch_bucket_size=N, N about one block's parameters).")
        return
    kind, _, device = choice.offload.partition("=")
    where = {"optimizer": f', offload_optimizer="{device}"',
             "params+optimizer": f', offload_optimizer="{device}", offload_param="{device}"'}.get(kind, "")
    # the strategy as code to paste: the checkpointing too (it was prose beside the call, a new-user trial)
    if choice.checkpointing != "none":
        where += f', activation_checkpointing="{choice.checkpointing}"'
    console.print(f"Chosen: {choice.name}. Strategy: AmpZeroStrategy(stage={choice.stage}{where})"
                  + ("" if choice.checkpointing == "none" else " (activation checkpointing of every block)") + ".")
    if choice.nvme:
        line = (f"NVMe per optimizer step: each rank reads {format_bytes(choice.nvme_read)} and writes"
                f" {format_bytes(choice.nvme_written)} of swap files; the node's {args.gpus_per_node} rank(s)"
                f" {format_bytes(choice.nvme_read_node)} and {format_bytes(choice.nvme_written_node)}")
        if bw:
            line += (f"; at {bw[0] / 1e9:.3g} GB/s read and {bw[1] / 1e9:.3g} GB/s write, at least"
                     f" {choice.io_seconds:,.1f} s per step of I/O alone.")
        else:
            line += ". Give --nvme-bandwidth (benchmarks/bench_nvme_io.py measures a drive) for the seconds this takes."
        console.print(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        return _plan(argv[1:])
    return _estimate(argv)


if __name__ == "__main__":
    sys.exit(main())
