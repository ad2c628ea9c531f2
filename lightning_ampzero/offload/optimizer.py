"""ZeRO-Offload for the optimizer: Adam/AdamW with master weights and moments off the accelerator.

:class:`OffloadedAdam` takes over a ``torch.optim.Adam``/``AdamW`` built by the user's
``configure_optimizers`` (after partitioning, so it holds this rank's shards). It shares the
wrapped optimizer's ``param_groups`` (LR schedulers keep driving them), keeps fp32 master
weights and Adam's moments in a :mod:`~lightning_ampzero.offload.store` (host memory or NVMe),
and runs the step on the host, one ``sub_group_size`` tile at a time:

    gradient shard  --D2H-->  tile  --fused AdamW (host)-->  master tile  --H2D-->  parameter shard

The host step is one vectorized pass per tile (``torch._fused_adamw_``, the CPU kernel
``torch.optim.AdamW(fused=True)`` uses), the same update rule as ``torch.optim.Adam``/``AdamW``.
On CUDA the copies go through pinned buffers with ``non_blocking`` and one wait per tile.

[Note: offloaded state in checkpoints] ``state_dict()`` has exactly the layout of the wrapped
torch optimizer's (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, DTensors sharded like
the parameters), built as views of the store (host memory, or memory-mapped swap files), so
``torch.distributed.checkpoint`` saves and reshards it like any optimizer state, and a
checkpoint written with offload resumes without it and the reverse. fp32 master weights equal
the fp32 parameters after every step, so they are restored from the loaded model; only when
the parameters are in a lower precision is a ``master`` entry added.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_ampzero._local import local_tensor
from lightning_ampzero.config import OffloadConfig
from lightning_ampzero.offload.store import HostStore, NvmeStore, tile_ranges


def _like_param(flat: Tensor, param: Tensor) -> Tensor:
    """``flat`` (a view of this rank's part) shaped and, for a DTensor parameter, sharded like ``param``."""
    from torch.distributed.tensor import DTensor

    local = flat.view(local_tensor(param).shape)
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def check_supported(optimizer: Optimizer) -> None:
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"offload.offload_optimizer runs Adam/AdamW on the host; configure_optimizers returned"
            f" {type(optimizer).__name__}. Use torch.optim.AdamW or torch.optim.Adam, or offload_optimizer='none'."
        )
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                raise ValueError(
                    f"offload.offload_optimizer does not support {type(optimizer).__name__}({key}=True). Remove"
                    f" {key}=True or set offload_optimizer='none'."
                )
        if isinstance(group.get("lr"), Tensor) and group["lr"].numel() != 1:
            raise ValueError("offload.offload_optimizer needs a scalar learning rate.")
    if any(optimizer.state.values()):
        raise ValueError("offload.offload_optimizer must wrap an optimizer that has not stepped yet.")


class _StateView(Mapping):
    """``optimizer.state`` of an :class:`OffloadedAdam`: per-parameter views built on access."""

    def __init__(self, owner: "OffloadedAdam") -> None:
        self._owner = owner

    def __getitem__(self, param: Tensor) -> dict[str, Tensor]:
        owner = self._owner
        if param not in owner._steps:
            raise KeyError(param)
        return owner._param_state(owner._where[param][0], param)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(list(self._owner._steps))

    def __len__(self) -> int:
        return len(self._owner._steps)


class OffloadedAdam(Optimizer):
    """Adam/AdamW stepping on the host over offloaded fp32 state (see the module docstring).

    Args:
        optimizer: the user's ``torch.optim.Adam``/``AdamW`` over this rank's (sharded) parameters;
            it must not have stepped. Its ``param_groups`` are shared, its own state stays empty.
        config: the :class:`~lightning_ampzero.config.OffloadConfig` (``offload_optimizer`` cpu or nvme).
        nvme_dir: directory for the swap files (``nvme`` only; already resolved from ``nvme_path``).
        rank: names this rank's swap directory.
        params: the :class:`~lightning_ampzero.offload.params.ParamSwapper` of parameters swapped to a
            file (``offload_param="nvme"``): their shards are read from it and the updated tiles
            written into it, never made resident as a whole.
        grads: the :class:`~lightning_ampzero.offload.grads.GradSwapper` of gradients swapped to a file
            (``offload_grad``); found through the parameters when not given. Swapped gradients are
            read tile by tile from the file (``pread``), never through ``p.grad``'s memory map.
    """

    def __init__(self, optimizer: Optimizer, config: OffloadConfig, *, nvme_dir: Optional[Path] = None,
                 rank: int = 0, params: Any = None, grads: Any = None) -> None:
        if config.offload_optimizer not in ("cpu", "nvme"):
            raise ValueError(f"OffloadedAdam needs offload_optimizer 'cpu' or 'nvme', got {config.offload_optimizer!r}.")
        check_supported(optimizer)
        self.optimizer = optimizer
        self.config = config
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self._decoupled = [bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
                           for g in self.param_groups]
        # Layout: each group's parameters (their local shards) laid end to end in one flat vector.
        self._where: dict[Tensor, tuple[int, int, int]] = {}  # param -> (group, offset, numel)
        self._layout: list[list[tuple[Tensor, int, int]]] = []
        sizes = []
        for g, group in enumerate(self.param_groups):
            entries, offset = [], 0
            for p in group["params"]:
                n = local_tensor(p).numel()
                entries.append((p, offset, n))
                self._where[p] = (g, offset, n)
                offset += n
            self._layout.append(entries)
            sizes.append(offset)
        self._offsets = [[off for _, off, _ in entries] for entries in self._layout]
        self._steps: dict[Tensor, Tensor] = {}
        self._closed = False
        self._params = params if params is not None and any(params.owns(p) for p in self._where) else None
        if grads is None:
            from lightning_ampzero.offload.grads import grad_swapper

            grads = next((s for s in map(grad_swapper, self._where) if s is not None), None)
        self._grads = grads if grads is not None and any(grads.owns(p) for p in self._where) else None
        device = next((local_tensor(p).device for p in self._where), torch.device("cpu"))
        # Pinned memory needs an accelerator: pinning fails on a CPU-only machine (FACTS.md).
        self._pin = bool(config.pin_memory and device.type == "cuda")
        self._device = device
        tile = int(config.sub_group_size)
        if config.offload_optimizer == "cpu":
            self.store: Any = HostStore(sizes, tile, self._pin)
        else:
            if nvme_dir is None:
                raise ValueError("offload_optimizer='nvme' needs a directory (offload.nvme_path).")
            self.store = NvmeStore(Path(nvme_dir), sizes, tile, config.buffer_count, config.io_threads, self._pin,
                                   rank=rank)
        self._grad_buffer: Optional[Tensor] = None
        self._load_master_from_params()

    def host_bytes(self) -> int:
        """Host memory held now: the store's (host copy, or NVMe tiles) and the tile gradients are copied into."""
        staged = self._grad_buffer.untyped_storage().nbytes() if self._grad_buffer is not None else 0
        return self.store.resident_bytes() + staged

    # ---- torch.optim.Optimizer surface -----------------------------------------------------------
    @property
    def state(self) -> Mapping:  # type: ignore[override]
        return _StateView(self)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("OffloadedAdam cannot be pickled: its state lives in host buffers / swap files.")

    def __repr__(self) -> str:
        return f"OffloadedAdam({type(self.optimizer).__name__}, offload_optimizer={self.config.offload_optimizer!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("OffloadedAdam does not support add_param_group: add the parameters before setup.")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif self._grads is not None and self._grads.holds(p):
                    self._grads.zero(p)  # in the file: zeroing through the map would fault it all in
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        self._check_open("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._params is not None:
            self._params.begin_update()  # no parameter read in flight or kept while the file changes
        if self._grads is not None:
            self._grads.begin_step()  # the gradient file is sound; map pages clipping faulted in go
        for g in range(len(self.param_groups)):
            self._step_group(g)
        self.store.flush()
        # LR schedulers hold the wrapped optimizer and warn if they step before it did.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return loss

    # ---- the host step -------------------------------------------------------------------------------
    def _hyper(self, g: int) -> dict[str, Any]:
        group = self.param_groups[g]
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        return {"lr": float(lr), "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"])}

    def _segments(self, g: int, a: int, b: int, with_grad: set[int]) -> list[tuple[Tensor, int, int, int]]:
        """(param, start in param, stop in param, start in tile) of the parameters overlapping [a, b)."""
        out = []
        entries = self._layout[g]
        for k in range(max(bisect.bisect_right(self._offsets[g], a) - 1, 0), len(entries)):
            p, off, n = entries[k]
            if off >= b:
                break
            if n == 0 or off + n <= a or id(p) not in with_grad:
                continue
            lo, hi = max(a, off), min(b, off + n)
            out.append((p, lo - off, hi - off, lo - a))
        return out

    def _host_grad(self, p: Tensor, lo: int, hi: int, tile_offset: int) -> Tensor:
        swapped = self._grads is not None and self._grads.holds(p)
        grad = None if swapped else local_tensor(p.grad).reshape(-1)[lo:hi]
        if grad is not None and grad.device.type == "cpu" and grad.dtype == torch.float32:
            return grad  # already a host fp32 view: no copy
        n = hi - lo
        if self._grad_buffer is None or self._grad_buffer.numel() < self.store.tile:
            self._grad_buffer = torch.empty(self.store.tile, dtype=torch.float32, pin_memory=self._pin)
        dst = self._grad_buffer[tile_offset : tile_offset + n]
        if grad is None:
            self._grads.read(p, lo, hi, dst)  # pread from the swap file, not through p.grad's map
        else:
            dst.copy_(grad, non_blocking=self._pin)
        return dst

    def _step_group(self, g: int) -> None:
        entries = self._layout[g]
        # A parameter whose shard on this rank is empty (uneven sharding) still steps, as in torch: its
        # (empty) state must exist on every rank for checkpoints to load.
        with_grad = {id(p) for p, _, _ in entries if p.grad is not None}
        if not with_grad:
            return
        for p, _, _ in entries:
            if id(p) in with_grad:
                step = self._steps.get(p)
                if step is None:
                    step = self._steps[p] = torch.zeros((), dtype=torch.float32)
                step += 1
        h = self._hyper(g)
        ranges = tile_ranges(self.store.group_sizes[g], self.store.tile)
        wanted = [i for i, (a, b) in enumerate(ranges) if self._segments(g, a, b, with_grad)]
        for tile in self.store.tiles(g, wanted):
            segs = self._segments(g, tile.start, tile.stop, with_grad)
            grads = [self._host_grad(p, lo, hi, t0) for p, lo, hi, t0 in segs]
            if self._pin:
                torch.cuda.current_stream(self._device).synchronize()  # D2H grads landed
            masters = [tile.master[t0 : t0 + hi - lo] for p, lo, hi, t0 in segs]
            m1 = [tile.exp_avg[t0 : t0 + hi - lo] for p, lo, hi, t0 in segs]
            m2 = [tile.exp_avg_sq[t0 : t0 + hi - lo] for p, lo, hi, t0 in segs]
            steps = [self._steps[p] for p, _, _, _ in segs]
            _adam_tile(masters, grads, m1, m2, steps, decoupled=self._decoupled[g], **h)
            for (p, lo, hi, _), master in zip(segs, masters):
                if self._params is not None and self._params.owns(p):
                    self._params.write(p, lo, hi, master)  # straight into the swap file
                else:
                    local_tensor(p).view(-1)[lo:hi].copy_(master, non_blocking=self._pin)
            event = None
            if self._pin:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self._device))
            self.store.done(tile, event)

    def _load_master_from_params(self, groups: Optional[set[int]] = None) -> None:
        """Master weights := the parameters (fp32 copy), for every tile of the given groups."""
        with torch.no_grad():
            for g, entries in enumerate(self._layout):
                if groups is not None and g not in groups:
                    continue
                if self.store.kind == "cpu":
                    master = self.store.full(g, "master")
                    for p, off, n in entries:
                        self._read_param(p, 0, n, master[off : off + n])
                    continue
                everything = set(id(p) for p, _, _ in entries)
                ranges = tile_ranges(self.store.group_sizes[g], self.store.tile)
                for tile in self.store.tiles(g, range(len(ranges))):
                    for p, lo, hi, t0 in self._segments(g, tile.start, tile.stop, everything):
                        self._read_param(p, lo, hi, tile.master[t0 : t0 + hi - lo])
                    self.store.done(tile)
            self.store.flush()

    def _read_param(self, p: Tensor, lo: int, hi: int, out: Tensor) -> None:
        """``out`` := elements ``[lo, hi)`` of ``p``'s local shard: from the swap file when it is swapped."""
        if self._params is not None and self._params.owns(p):
            self._params.read(p, lo, hi, out)
        else:
            out.copy_(local_tensor(p).reshape(-1)[lo:hi])

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _param_state(self, g: int, p: Tensor) -> dict[str, Any]:
        _, off, n = self._where[p]
        state: dict[str, Any] = {"step": self._steps[p]}
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = _like_param(self.store.full(g, name)[off : off + n], p)
        if p.dtype != torch.float32:
            state["master"] = _like_param(self.store.full(g, "master")[off : off + n], p)
        return state

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self._check_open("state_dict()")
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for g, group in enumerate(self.param_groups):
            packed = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                if p in self._steps:
                    state[index] = self._param_state(g, p)
                ids.append(index)
                index += 1
            packed["params"] = ids
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        self._check_open("load_state_dict()")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded optimizer state has {len(saved_groups)} parameter groups, this optimizer"
                             f" {len(self.param_groups)}.")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded optimizer state has a parameter group of a different size.")
            # In place: the wrapped optimizer (and its LR schedulers) share these dicts.
            group.update({k: v for k, v in saved.items() if k != "params"})
        keys = chain.from_iterable(s["params"] for s in saved_groups)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        loaded_state = state_dict["state"]
        with_master: set[int] = set()
        refresh = set(range(len(self.param_groups)))
        with torch.no_grad():
            for key, p in zip(keys, params):
                if key not in loaded_state:
                    continue
                g, off, n = self._where[p]
                st = loaded_state[key]
                self._steps[p] = torch.tensor(float(st["step"]), dtype=torch.float32)
                for name in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in st else ()):
                    dst = self.store.full(g, name)[off : off + n]
                    src = local_tensor(st[name]).reshape(-1)
                    if src.data_ptr() != dst.data_ptr() or src.device != dst.device:
                        dst.copy_(src)
                if "master" in st:
                    with_master.add(id(p))
            # Masters not in the checkpoint come from the (already loaded) parameters.
            if with_master:
                refresh = {g for g, entries in enumerate(self._layout) if any(id(p) not in with_master
                                                                              for p, _, _ in entries)}
        self._load_master_from_params(refresh)

    def close(self) -> None:
        """Free host buffers and delete NVMe swap files."""
        self._closed = True
        self.store.close()
        if self._grads is not None:
            # The name goes; swapped p.grad stay readable through the open file until the process ends.
            self._grads.unlink()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"OffloadedAdam.{what} after close(): the offloaded optimizer state was freed (and NVMe swap files"
                " deleted) when the strategy was torn down at the end of trainer.fit(). Save the checkpoint during"
                " fit instead: a ModelCheckpoint callback, or trainer.save_checkpoint(...) in a callback's"
                " on_train_end."
            )


def _adam_tile(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool) -> None:
    """One fused Adam(W) update of a tile's segments: the kernel of ``torch.optim.AdamW(fused=True)``."""
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=None, found_inf=None)


def is_offloaded(optimizer: Any) -> bool:
    return isinstance(getattr(optimizer, "_optimizer", optimizer), OffloadedAdam)
