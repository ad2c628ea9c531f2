"""``ampzero-train``: the Hydra main job (also ``python -m lightning_ampzero.train``).

With no arguments it trains the default small GPT on the shipped Shakespeare corpus with 2 CPU
processes and ZeRO stage 2, then prints a summary. Every field of the composed config can be
overridden (``strategy=zero3 precision=bf16-mixed strategy.reduce_bucket_size=5e5``); ``-m``
sweeps run their jobs one after another.

[Note: who starts the training processes]
Lightning's own launcher re-runs the whole command line in every child rank, with
``hydra.run.dir=<the parent's dir>`` appended. Under Hydra that re-composes the config per rank
(``${now:}`` and other per-process values can differ between ranks), writes Hydra's outputs
once per rank, and under ``-m`` makes every child run the whole sweep again: the long-standing
multirun + DDP problem. So this job starts the processes itself: the Hydra job (one per
multirun job) resolves its config once, writes it to ``<job dir>/.ampzero/job.json``, and starts
one worker per device, ``python -m lightning_ampzero.train --ampzero-worker <that file>``, with
Lightning's environment variables (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so Lightning sees processes created externally and launches
nothing. Workers never run Hydra: one job directory, one resolved config, no per-rank
directories. The Hydra job waits for its workers (stopping all of them if one fails), then
prints the summary rank 0 wrote. Where a launcher already started every rank (torchrun, srun,
``LOCAL_RANK`` set), each rank trains in its own process instead (``run.launcher=auto``).

[Note: validation before anything starts]
Before Hydra runs the job, :func:`preflight` composes the config of every job the command line
describes (each combination of a ``-m`` sweep) with Hydra's compose API and builds the typed
dataclasses, so a misspelt key or a bad value is reported, with a "did you mean", before any
process or directory is created.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_ampzero.hydra_schema import TrainAppConfig, conf_dir, explain_error, register_configs, typed_config
from lightning_ampzero.process import exit_process, exit_status, in_process_group

log = logging.getLogger(__name__)

WORKER_FLAG = "--ampzero-worker"
SPEC_FILE = Path(".ampzero") / "job.json"
SUMMARY_FILE = "summary.json"
CONFIG_NAME = "config"

# Hydra command-line flags that print something and exit without running the job.
_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")


class ConfigError(ValueError):
    """The command line does not compose into a valid config."""


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> Any:
    """The job (or, with ``--ampzero-worker``, one worker); returns. ``argv`` defaults to ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [WORKER_FLAG]:
        if len(args) != 2:
            raise SystemExit(f"usage: python -m lightning_ampzero.train {WORKER_FLAG} <job.json>")
        return worker_main(Path(args[1]))
    register_configs()
    args = quote_plain_values(args)
    try:
        check_machine(preflight(args))
    except ConfigError as e:
        print(f"ampzero-train: error: {e}\nNothing was started.", file=sys.stderr)
        raise SystemExit(2) from None
    args += _external_rank_overrides(args)
    import hydra

    sys.argv = [sys.argv[0], *args]
    entry = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name=CONFIG_NAME)(run_job)
    entry()
    return None  # cli_main passes this to sys.exit


def cli_main() -> None:
    """The ``ampzero-train`` console script and ``python -m lightning_ampzero.train``: :func:`main`, then exit.

    A process that was a rank itself (a worker, or one process / torchrun / SLURM in place) leaves
    through :func:`~lightning_ampzero.process.exit_process`: see [Note: exit without finalization]
    in process.py. :func:`main` itself returns, so calling it from Python keeps the interpreter.
    """
    code = main()
    if in_process_group():
        exit_process(exit_status(code))
    sys.exit(code)


def _parse_hydra_args(args: Sequence[str]) -> Any:
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(list(args))


def preflight(args: Sequence[str], *, max_jobs: int = 256) -> list[TrainAppConfig]:
    """Compose and validate the config of every job of this command line (see the module's notes).

    Returns the typed configs; raises :class:`ConfigError` with a message naming the key and,
    where one is close, the key or option that was probably meant.
    """
    if any(a in _INFO_FLAGS or a.startswith("--shell-completion") for a in args):
        return []
    try:
        ns = _parse_hydra_args(args)
    except SystemExit:
        return []  # Hydra's parser reports it when the job runs
    overrides = list(ns.overrides)
    jobs = _expand_sweep(overrides) if ns.multirun else [overrides]
    configs = []
    for job in jobs[:max_jobs]:
        configs.append(compose_typed(job, config_dir=ns.config_dir, config_name=ns.config_name or CONFIG_NAME,
                                     config_path=ns.config_path))
    return configs


_OVERRIDE = re.compile(r"^(~?\+{0,2}[\w.@/-]+)=(.*)$", re.S)


def quote_plain_values(args: Sequence[str]) -> list[str]:
    """Quote override values Hydra's grammar cannot read unquoted: with ``=`` or a non-ASCII character.

    Lightning names checkpoints ``epoch=0-step=20.ckpt``, and Hydra has no unquoted value with
    ``=`` in it (``mismatched input '='``); nor with a character such as ``ü`` (a path like
    ``/tmp/new user ü/run``: ``LexerNoViableAltException``, a trial). Quoting is the only reading
    such an override can have; values that already hold a quote, an interpolation or a sweep are
    left to Hydra.
    """
    out = []
    for arg in args:
        match = _OVERRIDE.match(arg) if not arg.startswith("-") else None
        value = match.group(2) if match else ""
        if match and ("=" in value or not value.isascii()) and not re.search(r"['\"$,\[\]{}()]", value):
            arg = f"{match.group(1)}='{value}'"
        out.append(arg)
    return out


def check_machine(apps: Sequence[TrainAppConfig]) -> None:
    """What a job needs from this machine, checked before any process starts (raises :class:`ConfigError`).

    A missing data file, a missing checkpoint or a GPU request on a machine without CUDA would
    otherwise fail in every worker, the cause buried under one traceback per rank.
    """
    for app in apps:
        data_path = app.data.path
        if data_path is not None and not Path(data_path).expanduser().is_file():
            raise ConfigError(
                f"data.path={data_path!r}: no such file{_abs_note(data_path)}. Give a readable file"
                " (data=text_file data.path=/path/to/corpus.txt), or use the shipped corpus (data=shakespeare)."
            )
        ckpt = app.run.ckpt_path
        if ckpt is not None and not Path(ckpt).expanduser().exists():
            raise ConfigError(
                f"run.ckpt_path={ckpt!r}: no such checkpoint{_abs_note(ckpt)}. Give a checkpoint directory written"
                " by a previous run (its job directory's checkpoints/), or leave run.ckpt_path unset."
            )
        if app.trainer.accelerator in ("gpu", "cuda"):
            import torch

            if not torch.cuda.is_available():
                built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
                raise ConfigError(
                    f"trainer.accelerator={app.trainer.accelerator!r}, but this machine has no usable CUDA device"
                    f" (torch {torch.__version__}, {built}). Use trainer=cpu, or run on a machine with a GPU."
                )
        on_cpu = app.trainer.accelerator == "cpu" or (app.trainer.accelerator == "auto" and not _cuda_available())
        if on_cpu:
            from lightning_ampzero.offload.setup import cpu_param_offload_problem

            problem = cpu_param_offload_problem(app.offload)
            if problem:  # else one traceback per rank after the processes start (a trial's converted config)
                raise ConfigError(problem)
        if app.offload.nvme_path is not None:  # else every worker failed after building the model
            from lightning_ampzero.offload.store import nvme_dir_problem

            problem = nvme_dir_problem(Path(app.offload.nvme_path))
            if problem:
                raise ConfigError(problem)
        from lightning_ampzero.data.text import too_few_windows, train_windows

        file = app.data.file
        windows = train_windows(app.data, file.stat().st_size) if file.is_file() else 0
        if windows:  # a batch larger than a process's share, said before the processes start, once the
            # devices are known to exist (a file too short for one window: the data module says it, in every rank)
            too_few = too_few_windows(app.data, windows, processes_per_node(app) * app.trainer.num_nodes)
            if too_few:
                raise ConfigError(too_few)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _abs_note(path: str) -> str:
    full = Path(path).expanduser().resolve()
    return f" (resolved to {str(full)!r} from {str(Path.cwd())!r})" if str(full) != path else ""


def _expand_sweep(overrides: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # a syntax error: say it now, Hydra would say the same later
        raise ConfigError(f"cannot parse the overrides {' '.join(overrides)}: {e}") from None
    if any(o.is_hydra_override() and o.key_or_group.startswith("hydra.sweeper") for o in parsed):
        return [[o.input_line for o in parsed if not o.is_sweep_override()]]
    try:
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception:  # sweeps the basic sweeper cannot expand (interval(), tag()) are the sweeper's
        return [[o.input_line for o in parsed if not o.is_sweep_override()]]
    return [job for batch in batches for job in batch]


def compose(overrides: Sequence[str] = (), *, config_dir: Optional[str] = None, config_name: str = CONFIG_NAME,
            config_path: Optional[str] = None) -> Any:
    """Compose ``ampzero-train``'s config (a DictConfig without the ``hydra`` node).

    Raises :class:`ConfigError` with an explained message when composition fails.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = list(overrides)
    if config_dir is not None:
        if not Path(config_dir).is_dir():
            # Hydra only warns and composes without it, so an experiment kept there read as "not an
            # option" (a docs trial ran the README's relative --config-dir from another directory).
            raise ConfigError(
                f"--config-dir {config_dir}: no such directory (resolved against the current directory:"
                f" {Path(config_dir).resolve()}). A relative path is read from where the command runs; give an"
                " absolute path, or run from the directory it is relative to."
            )
        # quoted: a folder named with a character such as ``ü`` broke Hydra's lexer on an override the
        # user never typed (a trial); Hydra itself adds --config-dir without an override
        overrides.append(f"hydra.searchpath=['file://{Path(config_dir).resolve()}']")
    # Hydra reads a relative --config-path against the file that declares the app (this one).
    primary = (Path(__file__).parent / config_path).resolve() if config_path else conf_dir()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(primary), version_base="1.3", job_name="train"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as e:
        message = explain_error(e) or _first_lines(str(e))
        override = _override_for(e, overrides)
        raise ConfigError(f"{message}{override}") from e
    finally:
        GlobalHydra.instance().clear()


def compose_typed(overrides: Sequence[str] = (), **kwargs: Any) -> TrainAppConfig:
    """:func:`compose`, then the typed config (raises :class:`ConfigError` for bad values)."""
    cfg = compose(overrides, **kwargs)
    try:
        return typed_config(cfg)
    except Exception as e:
        raise ConfigError(_first_lines(str(e))) from e


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n])


def _override_for(exc: BaseException, overrides: Sequence[str]) -> str:
    text = str(exc)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key and (f"'{key}'" in text or f"override {o}" in text or f"override '{o}'" in text):
            return f" (from the override '{o}')"
    return ""


def _external_rank_overrides(args: Sequence[str]) -> list[str]:
    """Extra overrides when a launcher started this process as one rank of several.

    Every rank composes the config then; they must agree on the run directory (``${now:}`` can
    differ between nodes), and only rank 0 writes Hydra's outputs.
    """
    ids = [("SLURM_JOB_ID", "slurm"), ("TORCHELASTIC_RUN_ID", "torchrun")]
    external = _external_world() > 1
    if not external:
        return []
    extra: list[str] = []
    keys = {a.split("=", 1)[0].lstrip("+") for a in args}
    for var, tag in ids:
        value = os.environ.get(var)
        if value and value != "none":
            step = os.environ.get("SLURM_STEP_ID", "")
            run_id = f"{tag}-{value}" + (f".{step}" if step and var == "SLURM_JOB_ID" else "")
            if "hydra.run.dir" not in keys:
                extra.append(f"hydra.run.dir=outputs/{run_id}")
            if "hydra.sweep.dir" not in keys:
                extra.append(f"hydra.sweep.dir=multirun/{run_id}")
            break
    if _env_global_rank() != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return extra


def _external_world() -> int:
    """How many ranks an outside launcher started (1 if none did)."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var)
        if value and value.isdigit():
            if var == "SLURM_NTASKS" and os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
                continue
            if var == "WORLD_SIZE" and "LOCAL_RANK" not in os.environ:
                continue
            return int(value)
    return 1


def _env_global_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0


# ---------------------------------------------------------------------------------------
# The Hydra job
# ---------------------------------------------------------------------------------------


def run_job(cfg: Any) -> Optional[float]:
    """Hydra task: validate, start the training processes of this node, print the summary.

    Returns the final training loss (Hydra records it per job; sweepers can optimize it).
    """
    from hydra.core.hydra_config import HydraConfig

    app = typed_config(cfg)
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    nprocs = processes_per_node(app)
    mode = launch_mode(app, nprocs)
    if mode == "local":
        summary = launch_local(app, job_dir, nprocs)
    else:
        summary = train(app, job_dir)
    if summary is None:  # a rank other than 0 under an external launcher
        return None
    if app.run.summary:
        print_summary(summary)
    with open(job_dir / "summary.txt", "w") as f:  # the tables, for logs and later reading
        from rich.console import Console

        print_summary(summary, Console(file=f, width=140, color_system=None))
    return summary.get("loss_last")


def processes_per_node(app: TrainAppConfig) -> int:
    devices = app.trainer.devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if devices in ("auto", -1):
        if app.trainer.accelerator in ("gpu", "cuda", "auto"):
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
            if app.trainer.accelerator != "auto":
                raise RuntimeError(f"trainer.accelerator={app.trainer.accelerator!r} but no CUDA device is visible.")
        return 1
    return int(devices)


def launch_mode(app: TrainAppConfig, nprocs: int) -> str:
    """``local`` (start this node's processes here) or ``in_process`` (this process is a rank)."""
    if app.run.launcher == "external":
        return "in_process"
    if app.run.launcher == "auto" and _external_world() > 1:
        return "in_process"
    if nprocs * app.trainer.num_nodes <= 1:
        return "in_process"
    return "local"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(app: TrainAppConfig, job_dir: Path, nprocs: int) -> dict[str, Any]:
    """Start ``nprocs`` workers on this node, wait for all of them, return rank 0's summary."""
    num_nodes = app.trainer.num_nodes
    if num_nodes > 1 and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            f"trainer.num_nodes={num_nodes}: run the same command on every node with MASTER_ADDR (node 0's"
            " address), MASTER_PORT and NODE_RANK set, or use a scheduler (trainer=slurm)."
        )
    spec = job_dir / SPEC_FILE
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"config": app.to_dict(), "job_dir": str(job_dir)}, indent=1))
    (job_dir / SUMMARY_FILE).unlink(missing_ok=True)
    threads = app.run.threads_per_process or max(1, (os.cpu_count() or 1) // nprocs)
    # The workers' environment is Lightning's own (LightningEnvironment, LOCAL_RANK set): drop what
    # would make Lightning detect another cluster environment (TorchElastic, a one-task SLURM job).
    hidden = ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")
    base = {k: v for k, v in os.environ.items() if k not in hidden}
    base.update(
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
        NODE_RANK=os.environ.get("NODE_RANK", "0"),
        WORLD_SIZE=str(nprocs * num_nodes),
        AMPZERO_THREADS=str(threads),
    )
    base.setdefault("OMP_NUM_THREADS", str(threads))
    package_root = str(Path(__file__).resolve().parent.parent)
    if "site-packages" not in package_root and "dist-packages" not in package_root:
        # A source checkout: make sure the workers import this same copy.
        base["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, base.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "lightning_ampzero.train", WORKER_FLAG, str(spec)]
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + app.run.timeout_s if app.run.timeout_s else None
    previous = _raise_on_sigterm()
    try:
        for local_rank in range(nprocs):
            procs.append(subprocess.Popen(cmd, env={**base, "LOCAL_RANK": str(local_rank)}))
        failed = _wait_all(procs, deadline)
    except (KeyboardInterrupt, _Terminated) as stopped:
        # [Note: the job stopped by a signal]
        name = "SIGINT" if isinstance(stopped, KeyboardInterrupt) else "SIGTERM"
        _stop(procs, grace_s=30.0, first_wait_s=5.0 if name == "SIGINT" else 0.0)
        print(f"ampzero-train: stopped by {name}; the training processes were stopped. Job directory: {job_dir};"
              f" {_latest_checkpoint(job_dir)}", file=sys.stderr)
        raise SystemExit(128 + (signal.SIGINT if name == "SIGINT" else signal.SIGTERM)) from None
    except BaseException:
        _stop(procs)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed is not None:
        rank, code = failed
        why = "ran past run.timeout_s" if code is None else f"exited with code {code}"
        raise RuntimeError(
            f"training process local rank {rank} {why}; the others were stopped. Its output is above;"
            f" job directory: {job_dir}"
        )
    path = job_dir / SUMMARY_FILE
    if not path.is_file():
        raise RuntimeError(f"the training processes finished without writing {path}.")
    return json.loads(path.read_text())


def _wait_all(procs: list[subprocess.Popen], deadline: Optional[float]) -> Optional[tuple[int, Optional[int]]]:
    """Wait until every process exits 0 (None), or one fails / the deadline passes (rank, code)."""
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                _stop(procs)
                return rank, code
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            return next(r for r, c in enumerate(codes) if c is None), None
        time.sleep(0.2)


# [Note: the job stopped by a signal]
# The workers are this process's children, not the launcher's of Lightning: a SIGTERM to
# ampzero-train (a scheduler's, ``kill``) ended it at once and left them training, re-parented, until
# the watchdog (a new-user trial), and Ctrl-C ended with Hydra's traceback of the wait loop. Both now
# reach the workers as Lightning expects them (SIGTERM: every rank stops after the next batch,
# [Note: a SIGTERM in the middle of a step] in sigterm.py; Ctrl-C reaches them from the terminal
# itself, so they get a few seconds to shut down on their own first), and the job ends with one
# line naming the latest checkpoint, and the shell's exit status for the signal (128 + its number).
class _Terminated(BaseException):
    """SIGTERM received while the workers run (raised by the handler :func:`_raise_on_sigterm` installs)."""


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise :class:`_Terminated` in this (main) thread; returns the handler it replaced, or None."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    raised = []

    def handler(signum: int, frame: Any) -> None:
        if not raised:  # once: a second SIGTERM must not cut the workers' shutdown short
            raised.append(signum)
            raise _Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _latest_checkpoint(job_dir: Path) -> str:
    found = sorted(job_dir.glob("checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    return f"latest checkpoint: {found[-1]} (resume with run.ckpt_path=...)" if found else "no checkpoint was written."


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0, first_wait_s: float = 0.0) -> None:
    end = time.monotonic() + first_wait_s
    for p in procs:  # a Ctrl-C reached them too: let them end on their own first
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_main(spec_path: Path) -> int:
    """One training process started by :func:`launch_local`."""
    spec = json.loads(Path(spec_path).read_text())
    app = typed_config(spec["config"])
    train(app, Path(spec["job_dir"]))
    return 0


# ---------------------------------------------------------------------------------------
# Training (one rank)
# ---------------------------------------------------------------------------------------


def _quiet_known_warnings() -> None:
    # Noise that says nothing about the user's run: lightning 2.6 calling a torch 2.13
    # deprecated pytree API, and the single-process DataLoader hint (the corpus is in memory).
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


def build_module(app: TrainAppConfig) -> Any:
    """The LightningModule of the job: the GPT, with the ``optim`` / ``scheduler`` nodes' optimizer."""
    from lightning_ampzero.deepspeed import build_optimizer, build_scheduler
    from lightning_ampzero.models.gpt import GPTModule

    class TrainModule(GPTModule):
        def configure_optimizers(self) -> Any:
            # GPTModule's grouping (no weight decay on biases, norms and position embeddings),
            # with the optimizer and schedule of the config.
            decay, no_decay = [], []
            for name, p in self.named_parameters():
                (decay if p.ndim >= 2 and "wpe" not in name else no_decay).append(p)
            groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
            optimizer = build_optimizer(app.optim, groups)
            scheduler = build_scheduler(app.scheduler, optimizer, lr=app.optim.lr,
                                        total_steps=self.trainer.estimated_stepping_batches)
            if scheduler is None:
                return optimizer
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return TrainModule(model=app.model, lr=app.optim.lr, weight_decay=app.optim.weight_decay, betas=app.optim.betas)


def progress_bar() -> Any:
    """Lightning's RichProgressBar, whose title reads "Epoch 0", not "Epoch 0/-2", in a run bounded by steps.

    With ``max_steps`` and no ``max_epochs`` Lightning's fit loop runs with ``max_epochs=-1``
    (unbounded), and the bar prints ``max_epochs - 1`` as the last epoch. The bar itself already
    counts the steps.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    class StepsProgressBar(RichProgressBar):
        @property
        def total_train_batches(self) -> Any:
            # Lightning's total in a run bounded by steps is the steps left (max_steps - global_step),
            # while the bar counts the epoch's batches from where the epoch stands: a run resumed
            # within its epoch read "30/19" (the loader resumes there, data/text.py). Batches, not
            # steps: a step takes accumulate_grad_batches of them.
            trainer = self.trainer
            if not (trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0):
                return super().total_train_batches
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            return min(trainer.num_training_batches, done + left)

        def _get_train_description(self, current_epoch: int) -> str:
            text = super()._get_train_description(current_epoch)
            max_epochs = self.trainer.max_epochs
            if max_epochs is not None and max_epochs < 0:
                text = text.replace(f"Epoch {current_epoch}/{max_epochs - 1}", f"Epoch {current_epoch}", 1)
            return text

    return StepsProgressBar(leave=True)


def _final_checkpoint(path: Path) -> Any:
    """A callback saving the resumable checkpoint (optimizer and loops too) at the end of training.

    In ``on_train_end``, not after ``fit()``: the strategy's teardown frees offloaded optimizer
    state (host buffers, NVMe swap files), so a save after ``fit()`` would have none to save.
    """
    from lightning.pytorch.callbacks import Callback

    class FinalCheckpoint(Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.save_checkpoint(path, weights_only=False)

    return FinalCheckpoint()


def train(app: TrainAppConfig, job_dir: Path) -> Optional[dict[str, Any]]:
    """Train in this process (one rank). Returns the summary on global rank 0, else None."""
    import torch
    import lightning.pytorch as pl

    from lightning_ampzero.cli.summary import SummaryCallback
    from lightning_ampzero.data.text import TextDataModule
    from lightning_ampzero.strategy import AmpZeroStrategy

    threads = app.run.threads_per_process or int(os.environ.get("AMPZERO_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    _quiet_known_warnings()
    pl.seed_everything(app.seed, workers=True, verbose=False)
    from lightning_ampzero.callbacks import MemoryReport
    from lightning_ampzero.estimate import gpt_activations

    summary_cb = SummaryCallback(app, job_dir)
    ac = app.activation_checkpointing
    # The estimate knows "none" and "full" of every block; other choices are shown against "none".
    every_block = ac.mode == "full" and ac.every_n == 1 and ac.number_checkpoints is None and not ac.modules
    memory = MemoryReport(
        log_every_n_steps=50, print_table=False,
        activation_estimate=gpt_activations(app.model, app.data.batch_size, app.data.block_size,
                                            precision=app.precision.precision or "32-true"),
        checkpointing="full" if every_block else "none",
    )
    callbacks: list[Any] = [summary_cb, memory]
    profiler = None
    if app.run.profile_steps:
        from lightning_ampzero.cli.profile import StepProfile

        profiler = StepProfile(app.run.profile_steps)
        callbacks.append(profiler)
    if app.trainer.enable_progress_bar:
        callbacks.append(progress_bar())
    periodic = app.run.checkpoint and app.run.checkpoint_every_n_steps is not None
    ckpt_dir = job_dir / "checkpoints"
    final_ckpt = ckpt_dir / "last.ckpt" if app.run.checkpoint else None
    if final_ckpt is not None:
        callbacks.append(_final_checkpoint(final_ckpt))
    if periodic:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=app.run.checkpoint_every_n_steps))
    logger: Any = False
    if app.run.logger == "csv":
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(str(job_dir), name="logs", version="")
    elif app.run.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(str(job_dir), name="logs", version="")
    trainer = pl.Trainer(
        **app.trainer.kwargs(),
        # The precision group's value is the strategy's PrecisionConfig.precision, which wins over
        # Trainer(precision=); not passing it avoids Lightning's CPU rewrite of "16-mixed".
        strategy=AmpZeroStrategy(config=app.amp_config),
        default_root_dir=str(job_dir),
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=periodic,
    )
    trainer.fit(build_module(app), datamodule=TextDataModule(app.data), ckpt_path=app.run.ckpt_path)
    if not trainer.is_global_zero:
        return None
    summary = summary_cb.summary
    summary["memory"] = memory.report
    summary["profile"] = profiler.result if profiler is not None else None
    summary["checkpoint"] = str(final_ckpt) if final_ckpt else None
    summary["logs"] = str(Path(logger.log_dir)) if logger else None
    summary["job_dir"] = str(job_dir)
    (job_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    return summary


def print_summary(summary: dict[str, Any], console: Any = None) -> None:
    from lightning_ampzero.cli.summary import render_summary

    render_summary(summary, console)


if __name__ == "__main__":
    cli_main()
