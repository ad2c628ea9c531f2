"""What the strategy calls to set offload up: the FSDP2 parameter-offload policy, the NVMe
directory, parameter swapping, and the optimizer wrapping (``strategy.py`` documents where each runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from lightning_ampzero._local import local_tensor
from lightning_ampzero.config import OffloadConfig
from lightning_ampzero.offload.optimizer import OffloadedAdam, is_offloaded
from lightning_ampzero.offload.store import NvmeOffloadError

_T = TypeVar("_T")


def swaps_parameters(config: OffloadConfig, device: torch.device) -> bool:
    """Whether stage-3 parameter shards go to a swap file: ``nvme``, or ``cpu`` on a CPU accelerator."""
    return config.offload_param == "nvme" or (config.offload_param == "cpu" and device.type == "cpu")


def param_offload_policy(config: OffloadConfig, device: torch.device, warn: Callable[[str], None]) -> Any:
    """FSDP2's offload policy for ``offload_param`` (stage 3); ``None`` = no offload.

    [Note: parameter offload on each accelerator] ``cpu`` on an accelerator: FSDP2's
    ``CPUOffloadPolicy`` keeps the parameter shards (and their gradients) in host memory and copies
    them to the accelerator for each all-gather. ``nvme`` on an accelerator: the same policy, the
    host copy of each shard being a view of a swap file or, while its unit all-gathers, of a pinned
    buffer (offload/params.py); FSDP2's own pinning stays off (``pin_memory=False``): it would
    replace the file views by pinned copies of whole shards when a checkpoint loads. With
    ``accelerator="cpu"`` the shards are host memory already and the policy fails there (it pins):
    ``nvme`` swaps them without it, and ``cpu``, which would be a no-op, swaps them to tmpfs
    (``/dev/shm``), which takes them out of the process's memory though not the machine's, with a
    warning that says so (``nvme`` is the setting that frees memory).
    """
    if config.offload_param == "none" or device.type == "cpu":
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=config.pin_memory and config.offload_param == "cpu")


def param_init_device(config: OffloadConfig, device: torch.device) -> torch.device:
    """Where a meta-built model is materialized: the host when its shards are offloaded."""
    return torch.device("cpu") if config.offload_param != "none" and device.type != "cpu" else device


TMPFS = Path("/dev/shm")


def resolve_nvme_dir(config: OffloadConfig, default_root_dir: str,
                     warn: Callable[[str], None]) -> tuple[Optional[Path], Optional[Path]]:
    """The directory for NVMe swap files: ``nvme_path``, or ``<default_root_dir>/ampzero_nvme`` (with a
    warning); and the outermost directory this made for it (None when it made none), for
    :func:`remove_default_nvme_dir`."""
    if "nvme" not in (config.offload_optimizer, config.offload_param, config.offload_grad):
        return None, None
    if config.nvme_path is not None:
        return Path(config.nvme_path), None
    path = Path(default_root_dir).absolute() / "ampzero_nvme"
    made = next((d for d in reversed([path, *path.parents]) if not d.exists()), None)
    path.mkdir(parents=True, exist_ok=True)
    what = " and ".join(w for w, d in (("optimizer state", config.offload_optimizer),
                                       ("parameters", config.offload_param),
                                       ("gradients", config.offload_grad)) if d == "nvme")
    warn(
        f"offload 'nvme' without offload.nvme_path: swapping {what} to {path} (under the Trainer's"
        " default_root_dir). Set nvme_path to a directory on a fast local NVMe drive."
    )
    return path, made


def remove_default_nvme_dir(config: OffloadConfig, path: Optional[Path], made: Optional[Path]) -> None:
    """End of fit: remove the ``ampzero_nvme`` folder :func:`resolve_nvme_dir` made, and the folders it
    made above it (``made``: a ``default_root_dir`` that did not exist), where they are empty.

    Each rank's swap files live in a folder of its own under it, removed at teardown; the default
    folder itself was left behind, empty, in the user's working directory, and then the
    ``default_root_dir`` made for it (new-user trials). Every rank tries, and the last one to finish
    finds them empty; a user's ``nvme_path``, and folders that were there before, are never touched.
    """
    if path is None or config.nvme_path is not None:
        return
    for folder in [path, *path.parents]:
        try:
            folder.rmdir()
        except OSError:  # another rank's swap folder is still there, or it is already gone
            return
        if made is None or folder == made:
            return


def set_up_together(step: Callable[[], _T], *, gather: Optional[Callable[[Any], list[Any]]],
                    ranks_on_node: int) -> _T:
    """This rank's part of a swap-file setup (``step``: parameter swapping, the optimizer wrapping),
    with its outcome decided by every rank: when one rank fails, every rank raises its message.

    [Note: a swap setup that fails on one rank]
    Each rank checks its own swap directory and space and creates its own files. With two ranks on
    a drive too small for both, the first to check passed and allocated, the second then found the
    space gone and raised, and the first never heard why: it met a closed connection in the next
    collective and printed gloo's and the TCP store's stack dumps before the watchdog's line (a
    new-user trial, 118 lines). Now the ranks exchange their outcome (``gather``: every rank's
    object, in rank order; None in a single process) and all raise the first failing rank's
    message; the files the others made are removed when they exit (their finalizers). The
    ``ranks_on_node`` processes of a node share its drive, so a message about space says that the
    drive needs room for all of them.
    """
    failure: Optional[BaseException] = None
    result: Any = None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before anyone goes on
        failure = e
    text = None if failure is None else (str(failure) if isinstance(failure, NvmeOffloadError)
                                         else f"{type(failure).__name__}: {failure}")
    said = gather(text) if gather else [text]
    failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
    if not failed:
        return result
    rank, text = failed[0]
    if ranks_on_node > 1 and " free but " in text:
        text += (f" The {ranks_on_node} ranks of a node share its drive, so it needs room for all their swap files,"
                 f" about {ranks_on_node} times what one rank needs; the free space above is what was left when"
                 " this rank checked.")
    if failure is not None and (len(said) == 1 or not isinstance(failure, NvmeOffloadError)):
        raise failure  # one process, or an error of another kind (a config's): its own type, as it was
    raise NvmeOffloadError(f"rank {rank} could not set up its swap files: {text}") from failure


def swap_parameters(model: torch.nn.Module, config: OffloadConfig, device: torch.device, *,
                    nvme_dir: Optional[Path], rank: int, warn: Callable[[str], None]) -> Any:
    """Stage 3: the :class:`~lightning_ampzero.offload.params.ParamSwapper` of ``model`` when its shards
    are swapped (:func:`swaps_parameters`), else None. Runs after partitioning and materialization.

    Also installs gradient swapping (:func:`swap_gradients`) when ``offload_grad`` asks for it: the
    strategy's one stage-3 swapping call, so that the optimizer wrapping after it finds both."""
    params = _swap_parameter_shards(model, config, device, nvme_dir=nvme_dir, rank=rank, warn=warn)
    swap_gradients(model, config, device, nvme_dir=nvme_dir, rank=rank)
    return params


def swap_gradients(model: torch.nn.Module, config: OffloadConfig, device: torch.device, *,
                   nvme_dir: Optional[Path], rank: int) -> Any:
    """Stage 3: the :class:`~lightning_ampzero.offload.grads.GradSwapper` of ``model`` when
    ``offload_grad`` (``auto`` resolved by :meth:`OffloadConfig.swaps_gradients`) swaps its gradient
    shards, else None. The optimizer finds it through the parameters (``OffloadedAdam``)."""
    from lightning_ampzero.offload.grads import apply_grad_offload, grad_swapper

    existing = grad_swapper(model)
    if existing is not None:
        return existing  # partitioned and swapped by an earlier fit
    on_host = device.type == "cpu" or config.offload_param != "none"
    if not config.swaps_gradients(stage=3, grads_on_host=on_host):
        if config.offload_grad == "nvme" and not on_host:
            raise ValueError(
                f"offload.offload_grad='nvme' with offload_param='none' on {device.type}: the gradient shards are"
                " reduced on the accelerator and stay there, and gradient swapping writes them from host memory."
                " Set offload_param='cpu' or 'nvme' (FSDP2 then moves them to the host), or offload_grad='auto'."
            )
        return None
    assert nvme_dir is not None, "resolve_nvme_dir gives a directory when offload_grad resolves to 'nvme'"
    return apply_grad_offload(model, nvme_dir, rank=rank)


def cpu_param_offload_problem(config: OffloadConfig) -> Optional[str]:
    """Why ``config`` cannot run on a CPU accelerator, or None (ampzero-train's pre-flight asks too)."""
    if config.offload_param == "cpu" and config.offload_optimizer == "none":
        return ("offload.offload_param='cpu' with accelerator='cpu' swaps the parameter shards to tmpfs (they are"
                " in host memory already), which needs offload_optimizer='cpu' or 'nvme' (the host step writes the"
                " updated parameters into the swap file). Set offload_optimizer, or offload_param='none'.")
    return None


def _swap_parameter_shards(model: torch.nn.Module, config: OffloadConfig, device: torch.device, *,
                           nvme_dir: Optional[Path], rank: int, warn: Callable[[str], None]) -> Any:
    from lightning_ampzero.offload.params import apply_param_offload, param_swapper

    if not swaps_parameters(config, device):
        return None
    existing = param_swapper(model)
    if existing is not None:
        return existing  # partitioned and swapped by an earlier fit
    if config.offload_param == "nvme":
        root, purpose = nvme_dir, "offload.offload_param='nvme'"
        assert root is not None, "resolve_nvme_dir gives a directory for offload_param='nvme'"
    else:
        problem = cpu_param_offload_problem(config)
        if problem:
            raise ValueError(problem)
        if not TMPFS.is_dir():
            raise ValueError(
                f"offload.offload_param='cpu' with accelerator='cpu' swaps the parameter shards to tmpfs at {TMPFS},"
                " which this machine does not have. Use offload_param='nvme' with nvme_path, or 'none'."
            )
        root, purpose = TMPFS, "offload.offload_param='cpu' (accelerator='cpu': tmpfs)"
        warn(
            f"offload.offload_param='cpu' with accelerator='cpu': the parameters are in host memory already, so their"
            f" stage-3 shards are swapped to files on tmpfs ({TMPFS}) and read back for each all-gather, as"
            " offload_param='nvme' does with a drive. This takes them out of the training processes' memory, not"
            " the machine's (tmpfs is memory). Use offload_param='nvme' with nvme_path on a drive to free memory,"
            " or 'none'."
        )
    return apply_param_offload(model, root, buffer_count=config.param_buffer_count,
                               buffer_size=config.param_buffer_size, io_threads=config.io_threads,
                               pin=config.pin_memory, rank=rank, purpose=purpose)


def wrap_optimizers(optimizers: Sequence[Any], config: OffloadConfig, *, nvme_dir: Optional[Path],
                    rank: int, params: Any = None, callbacks: Sequence[Any] = (),
                    warn: Callable[[str], None] = lambda message: None,
                    info: Callable[[str], None] = lambda message: None) -> list[Any]:
    """Replace each optimizer by an :class:`OffloadedAdam` over it (``offload_optimizer`` cpu / nvme);
    ``params``: the model's ParamSwapper, if its parameters are swapped. ``callbacks``: the Trainer's,
    checked for one that adds parameter groups later; ``warn``: told of frozen parameters it holds;
    ``info``: told of each replacement (a user who looks at ``trainer.optimizers`` finds another class)."""
    if config.offload_optimizer == "none":
        return list(optimizers)
    _refuse_groups_added_later(callbacks)
    for optimizer in optimizers:
        _warn_frozen(optimizer, warn)
    wrapped = [o if is_offloaded(o) else OffloadedAdam(o, config, nvme_dir=nvme_dir, rank=rank, params=params)
               for o in optimizers]
    where = ("on the host" if config.offload_optimizer == "cpu"
             else f"in swap files under {nvme_dir} (read in tiles through host buffers)")
    for before, after in zip(optimizers, wrapped):
        if after is not before:
            info(f"offload_optimizer={config.offload_optimizer!r}: trainer.optimizers holds {after!r}, which keeps"
                 f" the master weights and moments of your {type(getattr(before, '_optimizer', before)).__name__}"
                 f" {where} and runs its step on the host (same hyper-parameters and param_groups).")
    return wrapped


# [Note: what the offloaded optimizer holds]
# OffloadedAdam lays out master weights and moments for every parameter it is given, at setup (a
# flat store per group, tiled for the host step), where torch's Adam creates a parameter's state at
# its first gradient. So (two new-user trials, LoRA):
# - frozen parameters handed to the optimizer (``self.parameters()``, the usual LoRA code) cost
#   12 bytes per element of the shard in host memory (751x the adapters' on a 5M-parameter Llama),
#   which is what lets a layer a callback unfreezes later train exactly: say so, and how to avoid it;
# - a parameter group added mid-training (``add_param_group``, Lightning's ``BaseFinetuning``
#   callbacks such as ``BackboneFinetuning``) has no place in that layout, and the fit stopped at
#   the unfreezing epoch: refuse it at setup, with the way that works.
def _refuse_groups_added_later(callbacks: Sequence[Any]) -> None:
    from lightning.pytorch.callbacks import BaseFinetuning

    adding = [type(cb).__name__ for cb in callbacks if isinstance(cb, BaseFinetuning)]
    if adding:
        raise ValueError(
            f"{adding[0]} adds parameter groups to the optimizer when it unfreezes layers (add_param_group), and"
            " offload_optimizer lays out its host state for the parameters it is given at setup. Give the"
            " optimizer every parameter from the start (frozen ones stay as they are until their requires_grad is"
            " set) and unfreeze with requires_grad_(True) in a callback of your own, or drop offload_optimizer."
        )


def _warn_frozen(optimizer: Any, warn: Callable[[str], None]) -> None:
    from lightning_ampzero.estimate import format_bytes

    frozen = sum(local_tensor(p).numel() for group in optimizer.param_groups for p in group["params"]
                 if not p.requires_grad)
    if frozen:
        warn(f"offload_optimizer: the optimizer holds {frozen:,} elements of frozen parameters on this rank, and"
             f" keeps master weights and Adam moments for them ({format_bytes(12 * frozen)} of host memory"
             " (or NVMe)), so that they train if a callback unfreezes them. Pass only the trainable ones"
             " (torch.optim.AdamW(p for p in self.parameters() if p.requires_grad)) if they stay frozen.")


def close_optimizers(optimizers: Sequence[Any]) -> None:
    """Free offload buffers and delete NVMe swap files."""
    for o in optimizers:
        o = getattr(o, "_optimizer", o)
        if isinstance(o, OffloadedAdam):
            o.close()
