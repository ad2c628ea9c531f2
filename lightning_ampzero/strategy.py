"""AmpZeroStrategy: the Lightning Strategy of lightning_ampzero (Lightning lifecycle only).

Order of transforms in :meth:`AmpZeroStrategy.setup` (each one a function of its own module):

1. precision module conversion (``AmpZeroPrecision.convert_module``), then the FP8 swap
   (:func:`lightning_ampzero.fp8.convert_to_fp8`; a no-op unless ``fp8`` is configured),
2. activation checkpointing (:func:`lightning_ampzero.activation.apply_activation_checkpointing`:
   patches the chosen blocks' ``forward``; it must precede partitioning, see [Note: AC inside FSDP2]),
   then ``torch.compile`` of each block (:func:`lightning_ampzero.torch_compile.apply_compile`; a
   no-op unless ``compile`` is on; see [Note: compile order]),
3. partitioning: stage 0 wraps DDP; stages 1-3 call :func:`lightning_ampzero.zero.apply_zero`
   bottom-up (with FSDP2's CPUOffloadPolicy for ``offload_param``), then (stage 3) materialize the
   meta parameters: each rank's chunk kept by :class:`lightning_ampzero.zero.init.ZeroInit` while
   ``configure_model()`` ran (taken by name before step 1, whose FP8 wrapper replaces parameter
   objects), else ``reset_parameters`` for a model built on meta on purpose,
   Stage 3 with swapped parameters (``offload_param="nvme"``; ``"cpu"`` on a CPU accelerator) then
   moves each rank's shards into its swap file (:func:`lightning_ampzero.offload.setup.swap_parameters`),
   after any pretrained weights streamed in,
4. optimizers (created after sharding so they hold the shards), then optimizer offload
   (:func:`lightning_ampzero.offload.setup.wrap_optimizers`: ``offload_optimizer`` cpu / nvme; it
   reads and writes swapped parameters through their swap file),
5. precision plugin connection (loss scaler).
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Optional, Union

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_ampzero.checkpoint.at_exception import ExceptionSaveGate
from lightning_ampzero.checkpoint.sharded import (interrupted_saves_note, load_full_file, load_sharded,
                                                 remove_checkpoint_dir, save_sharded)
from lightning_ampzero.activation import apply_activation_checkpointing
from lightning_ampzero.config import AmpZeroConfig, stage0_bucket_mb
from lightning_ampzero.fp8 import convert_to_fp8, fp8_optimizers
from lightning_ampzero.fp8.convert import fp8_device_note
from lightning_ampzero.offload import setup as offload_setup
from lightning_ampzero.offload.optimizer import is_offloaded
from lightning_ampzero.offload.params import after_checkpoint
from lightning_ampzero.precision.plugin import AmpZeroPrecision
from lightning_ampzero.precision.policy import fp16_cpu_note
from lightning_ampzero.host_memory import keep_freed_host_memory
from lightning_ampzero.keywords import _keyword_signature, resolve_config
from lightning_ampzero.process import release_process_groups
from lightning_ampzero.torch_compile import apply_compile, compile_note
from lightning_ampzero.hf import load_pending_pretrained, refuse_own_save_pretrained
from lightning_ampzero.sigterm import AsyncSigtermBroadcast, sigterm_notifier
from lightning_ampzero.watchdog import start_watchdog, stop_watchdog
from lightning_ampzero.zero.buffers import sync_batchnorm_layers  # noqa: F401 (tests import it from here)
from lightning_ampzero.zero.averaged import (averaged_targets, pop_averaged_states, prepare_averaging_callbacks,
                                             refuse_whole_model_callbacks, restore_averaged_states,
                                             shard_averaged_copies)
from lightning_ampzero.zero.apply import (after_manual_step, apply_zero, fsdp_modules, gathers_in_other_dtypes,
                                         hpz_note, no_sync, overlap_comm_note, prepare_manual_backward,
                                         register_root_method, reshard_stale, run_outside_steps_in)
from lightning_ampzero.zero.init import ZeroInit, take_local_shards
from lightning_ampzero.zero.recover import in_step_method
from lightning_ampzero.zero.scalars import prepare_parameters_
from lightning_ampzero.zero.unused import UnusedTracker, generate_in_step, layerdrop_message, layers_dropped
from lightning_ampzero.zero.materialize import built_outside_note, materialize_meta_, move_real_tensors_

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


#: A backward that met parameters an earlier backward of the same step had freed ([Note: one
#: network per unit] in zero/units.py names the case the unit plan prevents).
FREED_IN_BACKWARD = (
    "This backward needs parameters that FSDP2 freed at the end of an earlier backward in the same step"
    " (torch's message is above): a graph built before another backward and optimizer step, going through"
    " an FSDP2 unit that the other backward also used, as a GAN's generator step does through a generator"
    " forward made before the discriminator's step, with both networks' layers in one unit. Keep each"
    " network in a child module of its own (self.generator, self.discriminator: units never span two),"
    " run the forward again after the other step, or make the model one unit (stages 1-2:"
    " zero.reduce_bucket_size above its parameter count)."
)


# [Note: a loss computed from a shard]
# At stage 3 a unit's parameters are whole only inside the unit's forward (and its backward); read
# anywhere else in a step method (an L2 penalty on ``self.model.layers[0].mlp.up_proj.weight``
# before or after ``self.model(...)``), a parameter is this rank's shard, a DTensor. So it is at
# stages 1-2 before the forward, in a model of several units (more parameters than
# ``zero.reduce_bucket_size``; [Note: units below stage 3] in zero/units.py). Arithmetic
# with it is DTensor arithmetic, so the term, and the loss it is added to, become DTensors, and
# torch's backward then stopped deep in the model with "aten.nll_loss_backward.default got mixed
# torch.Tensor and DTensor" (a new-user trial). ``term.full_tensor()`` is the term's whole value,
# and its gradient reaches the shard as DDP's does (tests/test_zero_shard_in_step.py measures it), so the
# message says that. A model of one unit (the default below stage 3) is gathered when a step
# method starts ([Note: backward inside a step method] in zero/apply.py), so there it is whole.
SHARD_IN_LOSS = (
    "The loss is a DTensor: part of it was computed from a parameter read outside its module's forward, where ZeRO"
    " keeps it as this rank's shard, a DTensor (at stage 3, and at stages 1-2 in a model split into several units),"
    " and torch's backward would stop with \"got mixed torch.Tensor and DTensor\". Take that term's whole value"
    " before adding it to the loss: `term = term.full_tensor() if isinstance(term, DTensor) else term` (from"
    " torch.distributed.tensor import DTensor; its gradient then equals DDP's), or compute it inside the module's"
    " forward; for an L2 penalty on the weights, the optimizer's weight_decay does it without reading them."
)


# The same shard, read in training_step before a forward and turned into another tensor: Lightning's
# own LightningLSTM demo makes its hidden state with ``next(self.parameters()).new_zeros(...)``, a
# DTensor at stage 3, and stopped in the LSTM on torch's "aten.mkldnn_rnn_layer.default got mixed
# torch.Tensor and DTensor" (a new-user trial).
MIXED_IN_STEP = (
    "An operation in training_step mixed a plain tensor with a DTensor (torch's message is above). At stage 3, and at"
    " stages 1-2 in a model split into several units, a parameter read outside its module's forward is this rank's"
    " shard, a DTensor, and so is every tensor made from it: a hidden state made with"
    " `next(self.parameters()).new_zeros(...)` (Lightning's LightningLSTM demo), or `weight.new_tensor(...)`. Make"
    " such tensors with torch.zeros(..., device=self.device), a plain tensor as under DDP, or inside the module's"
    " forward, where its parameters are whole. A loss term computed from a parameter takes `term.full_tensor()`."
)


#: Seconds the strategy's launcher waits, once a child rank has ended on an error, before it kills
#: the other ranks ([Note: a launcher that lets the live ranks report]).
LAUNCHER_GRACE_S = 4.0


class _PatientObserver(_ChildProcessObserver):
    """Lightning's child-process observer, giving the live ranks time to report before it kills them.

    [Note: a launcher that lets the live ranks report]
    Lightning's launcher (rank 0's process) checks its child ranks every 5 s and, when one has
    ended with an error, kills every rank at once. The ranks still alive are then usually in a
    collective that has just failed on the lost peer, and the watchdog's callback is writing the
    report that names it (watchdog.py: it reads every rank's record a beat and a half apart).
    Killed in the middle, that report was lost on some runs (it depended on where the kill fell in
    the 5-s period: tests/test_watchdog.py failed about one case in ten on a loaded machine). This
    observer waits :data:`LAUNCHER_GRACE_S` before it kills, so a run with a dead rank ends a few
    seconds later, with every live rank's report printed.
    """

    def _terminate_all(self) -> None:
        time.sleep(LAUNCHER_GRACE_S)
        super()._terminate_all()


class _PatientLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess-script launcher with :class:`_PatientObserver` as its child observer."""

    def launch(self, function, *args, trainer=None, **kwargs):  # type: ignore[no-untyped-def]
        # Lightning's launch, with the observer above in place of its own.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _PatientObserver(child_processes=self.procs, main_pid=os.getpid()).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class AmpZeroStrategy(ParallelStrategy):
    """ZeRO stages 0-3 on FSDP2 for Lightning, configured by one typed schema.

    Args:
        config: an :class:`AmpZeroConfig`, a DeepSpeed config (dict, or path to its JSON file), or None.
        **overrides: fields of :class:`ZeroConfig` (``stage``, ``reduce_bucket_size``,
            ``allgather_bucket_size``, ``prefetch_bucket_size``, ``param_persistence_threshold``,
            ``hpz_partition_size``, ``wrap_modules``, ``overlap_comm``, ``timeout_s``,
            ``process_group_backend``) or of
            :class:`AmpZeroConfig` (``precision``, ...). ``precision`` may be a precision string
            ("16-mixed", ...): it sets ``PrecisionConfig.precision``, which wins over ``Trainer(precision=)``.
            One given as None leaves the value of ``config``. The signature names them all, typed,
            for LightningCLI ([Note: keywords a LightningCLI sees]).
    """

    strategy_name = "ampzero"

    def __init__(
        self,
        config: Union[AmpZeroConfig, Mapping[str, Any], str, os.PathLike, None] = None,
        *,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Optional[Precision] = None,
        **overrides: Any,
    ) -> None:
        self.config, self.imported = resolve_config(config, overrides, say=rank_zero_info)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        # Stage 0's DDP under manual optimization: DDP must not prepare a backward after the step
        # method (manual_backward ran inside it), pre_backward prepares it instead (Lightning's ddp).
        self._forward_redirection = _DDPForwardRedirection()
        self._ddp_interrupted = False  # stage 0: a backward raised ([Note: a step interrupted by an exception])
        self._ddp_trainable: list[tuple[Tensor, bool]] = []  # stage 0: ([Note: parameters unfrozen during training])
        self._ddp_left_gradients: list[Tensor] = []  # stage 0: (_rewrap_ddp_before_backward)
        self._device_mesh: Any = None
        self.units: list[Any] = []
        self._fsdp_units: list[Any] = []  # the FSDPModules of the model (stages 1-3), for reshard_stale
        self.activation_checkpointing: Any = None  # what apply_activation_checkpointing did (setup)
        self.compiled: list[str] = []  # [compile] names of the blocks apply_compile compiled (setup)
        self._sigterm: Any = None  # (epoch loop, AsyncSigtermBroadcast) while fitting
        self._watchdog: Any = None  # (trainer, WatchdogCallback or None) while fitting
        self._at_exception = ExceptionSaveGate()  # [Note: a checkpoint at an exception] in checkpoint/at_exception.py
        self.param_swapper: Any = None  # [offload] ParamSwapper when stage-3 shards live in a swap file
        self._nvme_dir: Optional[Path] = None  # [offload] where this fit's swap folders are
        self._nvme_made: Optional[Path] = None  # [offload] the outermost folder made for them (removed if empty)
        self._unused: Optional[UnusedTracker] = None  # stages 1-3: [Note: parameters unused on some ranks]
        self._said: set[str] = set()  # setup's notes already warned (setup runs for fit, validate, test, ...)

    # ---- configuration -------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.config.zero.stage

    @property
    def precision_plugin(self) -> AmpZeroPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else AmpZeroPrecision(config=self.config.precision)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning builds its own plugin from Trainer(precision=...) and assigns it here; we
        # convert it, so the usual precision strings select ours (FACTS.md, integration traps).
        if plugin is not None and not isinstance(plugin, AmpZeroPrecision):
            plugin = AmpZeroPrecision.from_lightning(plugin, self.config.precision)
            if self.imported is not None:  # a DeepSpeed config's fp16 section under "enabled": "auto"
                config = self.imported.precision_config(plugin.precision, plugin.config)
                if config is not plugin.config:
                    plugin = AmpZeroPrecision(plugin.precision, config, device=plugin.device)
        self._precision_plugin = plugin

    @property
    def device_mesh(self) -> Any:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have been initialized (setup_environment).")
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    # ---- processes -----------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Also where the processes are created outside (the script's own children, torchrun, SLURM):
        # the launcher then starts nothing, but it gives each process its share of the cores
        # (torch threads = cores / processes per node unless OMP_NUM_THREADS is set), as for
        # Lightning's ddp. Without it each rank ran as many threads as the machine has cores.
        self._launcher = _PatientLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = self.config.zero.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.config.zero.timeout_s)}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        # Before the first step's allocations: [Note: page faults per step] in host_memory.py.
        keep_freed_host_memory(self.config.zero.host_memory_cache_mb,
                               map_large_blocks=self.config.offload.offload_param == "nvme")
        created = not torch.distributed.is_initialized()
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        if created:
            # The process group outlives fit() (later fits/tests reuse it); at exit, destroy it
            # and free it, so its threads stop before the interpreter finalizes (local, no
            # collective): [Note: exit without finalization] in process.py.
            import atexit

            atexit.register(release_process_groups)
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("dp",))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        # Before the callbacks' setup hooks: [Note: SWA's setup on a model already sharded] and [Note:
        # EMAWeightAveraging at stages 1-3] in zero/averaged.py
        prepare_averaging_callbacks(self._callbacks(), self._reshard)
        if self.stage > 0:
            refuse_whole_model_callbacks(self._callbacks(), self.stage)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- model ---------------------------------------------------------------------------
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Stage 3 must never hold the whole model on one rank, yet must start from the exact
        # one-process weights: configure_model() runs on real tensors and each parameter keeps
        # only this rank's chunk once it is built ([Note: partitioned construction] in
        # zero/init.py); setup() copies the chunks into the sharded parameters. Full parameters
        # alive at once are bounded by prefetch_bucket_size, the live-parameter budget of training.
        if self.stage != 3:
            yield
            return
        group = self._device_mesh.get_group() if self._device_mesh is not None else None
        with ZeroInit(group, max_live_numel=int(self.config.zero.prefetch_bucket_size)):
            yield

    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        # A DeepSpeed config's optimizer/scheduler sections stand in for a missing
        # configure_optimizers; install them here, before Lightning checks that the module has
        # one (_verify_loop_configurations runs between connect() and setup()). See _deepspeed/result.py.
        if self.imported is not None:
            self.imported.install_optimizers(model)

    def _say_once(self, note: Optional[str], say: Callable[[str], Any] = rank_zero_warn) -> None:
        if note is not None and note not in self._said:
            self._said.add(note)
            say(note)

    def _compile(self, module: torch.nn.Module) -> None:
        self.compiled = apply_compile(module, self.config.compile)
        if self.compiled:
            self._say_once(compile_note(module, self.compiled, self.config.compile), rank_zero_info)

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.imported is not None:
            self.imported.apply_to_trainer(trainer)
        # Once per strategy, not at each of fit, validate and test (a trial saw the FP8 note three times).
        for note in (fp8_device_note(self.config.fp8, self.root_device),
                     fp16_cpu_note(self.precision_plugin.precision, self.root_device),
                     overlap_comm_note(self.config.zero, torch.distributed.get_backend())):
            self._say_once(note)
        self._say_once(hpz_note(self.config.zero, self.world_size), rank_zero_info)
        module = self.model
        self._ddp_interrupted = False  # a new fit wraps a new DDP
        params = list(module.parameters())
        if trainer.state.fn == TrainerFn.FITTING and params and not any(p.requires_grad for p in params):
            # (a trial's all-frozen model trained silently, changing nothing; Lightning's ddp refuses it)
            rank_zero_warn(f"No parameter of the model requires a gradient ({len(params)} parameters, all frozen):"
                           " fit() will change no weight. Unfreeze what should train (requires_grad_(True)), or"
                           " use trainer.validate / predict to only run the model.")
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule) and trainer.state.fn == TrainerFn.FITTING:
            module = sync_batchnorm_layers(self._layer_sync, module, self.root_device.type, self.world_size)
        if isinstance(module, FSDPModule):
            # Partitioned by an earlier fit/validate/test with this strategy: keep the shards, and make
            # them the module's parameters again ([Note: units left gathered by evaluation]).
            self._reshard()
        elif self.stage == 0:
            module = self.precision_plugin.convert_module(module)
            # [fp8] after the precision conversion (it would cast the FP8 scaling buffers); DDP
            # cannot broadcast the FP8 all-gather wrapper, and has no all-gather anyway.
            module = convert_to_fp8(module, self.config.fp8, fp8_all_gather=False)
            self._apply_activation_checkpointing(module)
            self._compile(module)  # [compile] after AC, before DDP
            module.to(self.root_device)
            self.model = self._wrap_ddp(module)
            # [precision] DDP has no mixed-precision policy: the plugin adds "-true" compute copies
            # of the fp32 parameters and a comm hook for the reduction dtypes (precision/ddp.py).
            self.precision_plugin.setup_ddp(self.model)
        else:
            prepare_parameters_(module)  # [Note: parameters FSDP2 refuses]: before anything reads their shapes
            shards: dict[str, Tensor] = {}
            if self.stage == 3:
                note = built_outside_note(module)
                if note is not None:
                    rank_zero_info(note)
                shards = take_local_shards(module)  # by name: the FP8 swap may replace parameter objects
            module = self.precision_plugin.convert_module(module)
            # [fp8] swap nn.Linear for Fp8Linear (on meta modules under stage 3), before sharding.
            module = convert_to_fp8(module, self.config.fp8)
            self._apply_activation_checkpointing(module)
            # [compile] each block, after checkpointing and before sharding ([Note: compile order]).
            self._compile(module)
            # [offload] parameter shards in host memory (stage 3; on CPU a no-op, with a warning).
            offload_policy = offload_setup.param_offload_policy(self.config.offload, self.root_device, rank_zero_warn)
            move_real_tensors_(module, self.root_device)  # meta parameters stay for materialize_meta_
            # [precision] one FSDP2 policy for every unit, plus the modules that need a unit and a
            # policy of their own ("-mixed": lower_precision_safe_modules reduce in the low dtype).
            mp_policy, module_policies = self.precision_plugin.fsdp_policies(module, self.stage)
            self.units = apply_zero(module, self.device_mesh, self.config.zero, mp_policy,
                                    module_policies=module_policies, offload_policy=offload_policy)
            self.activation_checkpointing.after_sharding(module)  # [Note: sharding hooks inside a selectively checkpointed block]
            # [Note: parameters unused on some ranks] in zero/unused.py
            mesh = self.device_mesh
            self._unused = UnusedTracker(mesh.get_group() if mesh.ndim == 1 else None)
            self._unused.install(module)
            generate_in_step(module)  # [Note: generate() on some ranks] in zero/unused.py
            refuse_own_save_pretrained(module, self.stage)  # [Note: save_pretrained of a sharded model] in hf/export.py
            shard_averaged_copies(trainer.callbacks, module)  # [Note: an averaged copy of a sharded model]
            if trainer.state.fn == TrainerFn.FITTING and (dropping := layers_dropped(module)):
                rank_zero_warn(layerdrop_message(dropping, self.stage))  # [Note: layers dropped on some ranks]
            materialize_meta_(module, offload_setup.param_init_device(self.config.offload, self.root_device), shards)
            # Lightning calls training_step() etc., not forward(): make them run FSDP2's
            # root hooks too, or the root unit's parameters would stay sharded.
            register_root_method(module, *_STEP_METHODS)
            if gathers_in_other_dtypes(module):  # [Note: a stage-3 model called after fit] in zero/apply.py
                run_outside_steps_in(module, self.precision_plugin.forward_context)
            self.model = module
        self._fsdp_units = fsdp_modules(self.model) if self.stage > 0 else []
        # [pretrained] models built by lightning_ampzero.hf.from_pretrained stream each rank's rows
        # of their checkpoint into place, before Lightning restores a checkpoint of its own over them.
        load_pending_pretrained(self.model)
        nvme_dir, self._nvme_made = offload_setup.resolve_nvme_dir(self.config.offload, trainer.default_root_dir,
                                                                   rank_zero_warn)
        self._nvme_dir = nvme_dir
        if self.stage == 3:
            # [offload] offload_param='nvme': every shard into this rank's swap file, read back per all-gather.
            self.param_swapper = self._set_up_together(lambda: offload_setup.swap_parameters(
                self.model, self.config.offload, self.root_device, nvme_dir=nvme_dir, rank=self.global_rank,
                warn=rank_zero_warn))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            # [fp8] msamp O2: Adam/AdamW -> Fp8AdamW (FP8/fp16 moments); otherwise unchanged.
            self.optimizers = fp8_optimizers(self.optimizers, self.lr_scheduler_configs, self.config.fp8)
            # [offload] master weights + Adam moments to the host / NVMe; the step runs there.
            optimizers = self.optimizers
            self.optimizers = self._set_up_together(lambda: offload_setup.wrap_optimizers(
                optimizers, self.config.offload, nvme_dir=nvme_dir, rank=self.global_rank, params=self.param_swapper,
                callbacks=trainer.callbacks, warn=rank_zero_warn, info=rank_zero_info))
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device([o for o in self.optimizers if not is_offloaded(o)], self.root_device)
            self._install_sigterm_broadcast(trainer)
            # The hang detector watches the training loop ([Note: hang detection] in watchdog.py).
            self._watchdog = (trainer, start_watchdog(trainer, self.config.zero.watchdog_seconds))

    def _set_up_together(self, step: Any) -> Any:
        """``step`` (a swap-file setup), its outcome decided by every rank.

        [Note: a swap setup that fails on one rank] in offload/setup.py.
        """
        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(out, obj)
            return out

        # (a swap directory is resolved exactly when something goes to NVMe; tmpfs for offload_param='cpu' on CPU)
        files = self._nvme_dir is not None or offload_setup.swaps_parameters(self.config.offload, self.root_device)
        # Only a setup that makes swap files can fail on one rank alone: no collective for the others.
        return offload_setup.set_up_together(step, gather=gather if self.world_size > 1 and files else None,
                                             ranks_on_node=self.num_processes)

    def _install_sigterm_broadcast(self, trainer: "pl.Trainer") -> None:
        # Lightning's per-batch SIGTERM broadcast, made asynchronous: [Note: asynchronous SIGTERM
        # broadcast] in sigterm.py. An instance attribute over the loop's method, removed at teardown.
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        connector = getattr(trainer, "_signal_connector", None)
        if self.world_size > 1 and callable(getattr(loop, "_broadcast_sigterm_tensor", None)):
            # [Note: a SIGTERM in the middle of a step] in sigterm.py: Lightning registers its handler
            # after setup, from this attribute: the one here issues no collective.
            if connector is not None and callable(getattr(connector, "_sigterm_notifier_fn", None)):
                connector._ampzero_sigterm = False
                connector._sigterm_notifier_fn = sigterm_notifier(connector, self.local_rank)

            def stop() -> None:
                if connector is not None:
                    connector.received_sigterm = True

            check = AsyncSigtermBroadcast(
                lambda: trainer.received_sigterm or bool(getattr(connector, "_ampzero_sigterm", False)),
                self.root_device, SIGTERMException, on_stop=stop)
            loop._broadcast_sigterm_tensor = check  # type: ignore[union-attr]
            self._sigterm = (loop, check, connector)

    def _apply_activation_checkpointing(self, module: torch.nn.Module) -> None:
        try:
            self.activation_checkpointing = apply_activation_checkpointing(
                module, self.config.activation_checkpointing, mesh=self._device_mesh, warn=rank_zero_warn)
            if self.activation_checkpointing.enabled:
                rank_zero_info(self.activation_checkpointing.summary())
        except ValueError as e:
            # A DeepSpeed config's section turned it on (DeepSpeed itself would do nothing for a model that
            # never calls its checkpointing API): say where it came from (a migration trial).
            if self.imported is None or not any(key == "activation_checkpointing" for key, _ in self.imported.notes):
                raise
            raise ValueError(f"{e} It was turned on by the activation_checkpointing section of the DeepSpeed config"
                             f" {self.imported.source}: remove that section to train without checkpointing.") from None

    def _wrap_ddp(self, module: torch.nn.Module, init_sync: bool = True) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        bucket_mb = stage0_bucket_mb(self.config.zero.reduce_bucket_size)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        # Manual optimization often backpropagates through part of the model at a time (a GAN's
        # two optimizers), as FSDP2 at stages 1-3 and DeepSpeed's stage 0 allow: DDP must look for
        # the parameters each backward leaves out, or it waits for their gradients.
        # zero.find_unused_parameters=False turns it off for a manual model whose backwards reach every parameter.
        find = self.config.zero.find_unused_parameters
        if find is None:
            find = self.lightning_module is not None and not self.lightning_module.automatic_optimization
        ddp = DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=bucket_mb,
                                      find_unused_parameters=find, init_sync=init_sync)
        self._ddp_trainable = [(p, p.requires_grad) for p in module.parameters()]
        return ddp

    def _rewrap_ddp_if_trainable_changed(self, in_step: bool = False) -> bool:
        """Stage 0: a new DDP when parameters were unfrozen or frozen since the last one was built.

        [Note: parameters unfrozen during training] DDP reduces only the parameters that required
        gradients when it was built. One unfrozen later (Lightning's ``BackboneFinetuning``, a
        ``requires_grad_(True)`` in a callback) trained on each rank's own gradient, never averaged,
        so the ranks' copies drifted apart without a word (0.02 after two epochs, a new-user trial,
        issue 16's note; Lightning's ddp does the same); one frozen later made DDP wait for a
        gradient that never comes. Stages 1-3 (FSDP2) reduce whatever has a gradient. So before each
        training step the flags are compared with those DDP was built with (a walk over the
        parameters: microseconds), and on a change DDP is built again over the same module; its
        construction broadcasts rank 0's parameters and buffers, as at setup. A change made inside
        ``training_step`` is found before its backward (:meth:`backward`). Returns whether DDP was built again.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(self.model, DistributedDataParallel):
            return False
        if in_step:
            # Inside a step only a change DDP cannot absorb: a parameter it does not reduce that now trains,
            # or one it waits for that is frozen now, unless it looks for unused ones (toggle_optimizer)
            find = self.model.find_unused_parameters
            if not any(p.requires_grad and not flag or flag and not p.requires_grad and not find
                       for p, flag in self._ddp_trainable):
                return False
        elif all(p.requires_grad == flag for p, flag in self._ddp_trainable):
            return False
        before = sum(flag for _, flag in self._ddp_trainable)
        module = self.model.module
        self.model = None  # the old reducer's autograd hooks go with it, before the new one adds its own
        gc.collect()
        # inside a step the forward's graph holds the parameters: no broadcast into them (they agree)
        self.model = self._wrap_ddp(module, init_sync=not in_step)
        self.precision_plugin.setup_ddp(self.model)
        now = sum(flag for _, flag in self._ddp_trainable)
        rank_zero_info(f"Stage 0 (DDP): the trainable parameters changed ({before} tensors trained, now {now}), so"
                       " DDP was built again to average the gradients of those that train now.")
        return True

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_ddp_not_interrupted()
        self._rewrap_ddp_if_trainable_changed()
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as error:
            if self.stage != 0 and "got mixed torch.Tensor and DTensor" in str(error):
                raise RuntimeError(MIXED_IN_STEP) from error
            if self.stage != 0 or "Expected to have finished reduction in the prior iteration" not in str(error):
                raise
            raise RuntimeError(
                "Stage 0 is DDP, which needs a gradient for every parameter that requires one in every"
                " backward, and some parameters of this model got none (torch's message is above). Use stage 1,"
                " 2 or 3, which allow it (FSDP2), freeze the parameters the loss does not use"
                " (requires_grad=False), or set find_unused_parameters=True (AmpZeroStrategy's keyword,"
                " zero.find_unused_parameters), under which stage 0 looks for them."
                " TORCH_DISTRIBUTED_DEBUG=INFO makes torch name them."
            ) from error

    def _rewrap_ddp_before_backward(self, loss: Tensor) -> bool:
        """Stage 0: ``requires_grad`` changed inside ``training_step``, after DDP prepared this step.

        A layer frozen there (``self.encoder.requires_grad_(False)``) left DDP waiting for its
        gradient, so the bucket holding it was never averaged, and one unfrozen there trained on
        each rank's own gradient: the ranks drifted apart (0.04 after 8 steps, against ddp with
        find_unused_parameters=True). The new DDP, built over the flags as they are now, is
        prepared for this backward as the old one was in its forward (under manual optimization
        ``pre_backward`` does that). Under the old one's no_sync (a micro-batch before the last of an
        accumulation window) the new one skips this backward's reduction too, and syncs again after
        it: the no_sync block, entered on the old object, restores only that one (left unsynced, the
        ranks drifted apart: 0.07 on a BERT with accumulate_grad_batches=2, a new-user trial).
        Returns whether the caller must make the new DDP sync again after the backward.
        """
        old, built_with = self.model, self._ddp_trainable
        if self.stage != 0 or not self._rewrap_ddp_if_trainable_changed(in_step=True):
            return False
        # Frozen inside an accumulation window, a parameter keeps the gradient of the micro-batches
        # before: the old DDP would have averaged it in the window's last backward (as an unused
        # parameter's), and the optimizer steps it; the new one does not hold it, so that
        # backward averages it here (_average_left_gradients).
        self._ddp_left_gradients += [p for p, flag in built_with if flag and not p.requires_grad and p.grad is not None]
        self.model.require_backward_grad_sync = old.require_backward_grad_sync
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, loss)
        return not old.require_backward_grad_sync

    def pre_backward(self, closure_loss: Tensor) -> None:
        from torch.nn.parallel import DistributedDataParallel

        assert self.lightning_module is not None
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        # [Note: a step interrupted by an exception] in zero/recover.py
        self._check_ddp_not_interrupted()
        if isinstance(closure_loss, DTensor):  # [Note: a loss computed from a shard]
            raise RuntimeError(SHARD_IN_LOSS)
        resync = self._rewrap_ddp_before_backward(closure_loss)
        # [Note: backward inside a step method] in zero/apply.py (manual optimization)
        prepare_manual_backward(self.model, closure_loss)
        try:
            out = super().backward(closure_loss, optimizer, *args, **kwargs)
        except BaseException as error:
            self._ddp_interrupted = self.stage == 0
            if self.stage > 0 and isinstance(error, RuntimeError) and "storage of size 0" in str(error):
                raise RuntimeError(FREED_IN_BACKWARD) from error
            raise
        finally:
            if resync:  # the no_sync block this backward ends was entered on the old DDP: it cannot reset the new one
                self.model.require_backward_grad_sync = True
        if self._ddp_left_gradients and not resync and self.model.require_backward_grad_sync:
            self._average_left_gradients()
        return out

    def _average_left_gradients(self) -> None:
        """Stage 0, after a reducing backward: average the gradients left on parameters frozen in the window."""
        left, self._ddp_left_gradients = self._ddp_left_gradients, []
        grads = [p.grad for p in left if not p.requires_grad and p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.world_size)  # DDP divides before its all-reduce
            for grad in grads:
                torch.distributed.all_reduce(grad)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        after_manual_step(self.model)  # [Note: backward inside a step method] in zero/apply.py
        if self.stage > 0 and not in_step_method():
            reshard_stale(self._fsdp_units)  # [Note: a step without a backward] in zero/apply.py
        return result

    def _check_ddp_not_interrupted(self) -> None:
        if self._ddp_interrupted:
            raise RuntimeError(
                "An exception interrupted a backward at stage 0 and the training went on (it was caught)."
                " Stage 0 is torch's DistributedDataParallel, whose reducer cannot be reset after a backward"
                " stopped half way: its next step would fail. Let the exception end the run, or use stage 1,"
                " 2 or 3, where the interrupted step is reset and training goes on (its gradients are lost)."
            )

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.stage == 0:
            with super().block_backward_sync():
                yield
            return
        assert self.lightning_module is not None
        with no_sync(self.lightning_module, self.stage):
            yield

    def _reshard(self) -> None:
        """Put every unit back to its shards after a forward that had no backward (evaluation).

        [Note: units left gathered by evaluation] A unit is resharded by its backward; evaluation
        has none, so after it the units FSDP2 keeps gathered past their forward (every unit at
        stages 1-2, the root and the persistent units at stage 3) stayed gathered, and their
        module attributes were the gathered plain tensors, not the sharded DTensors. A fit after a
        standalone ``trainer.validate`` at stage 3 then built its optimizer over those copies: it
        stepped tensors FSDP2 dropped at the next reshard, and the fit left the model's weights as
        they were, silently (a new-user trial, issue 16's note). Resharding frees the full model
        and gives the module its shards back.
        """
        if self.stage > 0 and self.lightning_module is not None:
            for m in fsdp_modules(self.lightning_module):
                m.reshard()

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self.is_global_zero and trainer.ckpt_path is None:
            # A fit from scratch beside a killed run's saves: ckpt_path="last" finds no last.ckpt when the
            # kill came in the first one's save, and Lightning then starts from step 0 (a new-user trial).
            # (trainer.ckpt_path: what this fit restored, set by Lightning's resume_start, kept after it.)
            for directory in {str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}:
                note = interrupted_saves_note(Path(directory))
                if note is not None:
                    self._say_once("This fit starts from step 0 (no checkpoint was loaded). If it should continue a"
                                   " killed run, pass ckpt_path=<a complete checkpoint>. " + note)
        if self.imported is not None and trainer is not None:
            self.imported.check_dataloader(trainer)
            resolved = self.imported.auto_values(trainer, self.config)
            if resolved:
                rank_zero_info(f'DeepSpeed config {self.imported.source}: its "auto" values in this run: '
                               + "; ".join(resolved) + ".")

    def on_validation_end(self) -> None:
        self._reshard()

    def on_test_end(self) -> None:
        self._reshard()

    def on_predict_end(self) -> None:
        self._reshard()

    # ---- collectives ---------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if name == "Trainer.save_checkpoint":  # the end of a save: one at an exception may have been skipped
            skip = self._at_exception.skip(self)
            self._at_exception.end_save()
            if skip:
                return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        if self._watchdog is not None:
            stop_watchdog(*self._watchdog)
            self._watchdog = None
        if self._sigterm is not None:
            loop, check, connector = self._sigterm
            check.forget()
            loop.__dict__.pop("_broadcast_sigterm_tensor", None)
            if connector is not None:
                connector.__dict__.pop("_sigterm_notifier_fn", None)
            self._sigterm = None
        offload_setup.close_optimizers(self.optimizers)  # [offload] host buffers, NVMe swap files
        if self.param_swapper is not None:
            # [offload] the swap file's name goes; its data stays open for the model until the process ends.
            self.param_swapper.unlink()
        offload_setup.remove_default_nvme_dir(self.config.offload, self._nvme_dir, self._nvme_made)
        ac = self.activation_checkpointing
        if ac is not None and ac.config.profile and ac.profile:
            rank_zero_info("activation checkpointing profile (per call):\n" + ac.report())
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints (sharded directory through torch.distributed.checkpoint) -------------
    def _state_module(self) -> torch.nn.Module:
        assert self.lightning_module is not None
        return self.lightning_module

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self._at_exception.skip(self):  # a save at an exception that not every rank is in: nothing to collect
            return {}
        return get_model_state_dict(self._state_module(), options=StateDictOptions(cpu_offload=True))

    def _model_state(self) -> dict[str, Any]:
        """The model's state dict as it lives (sharded DTensors at stages 1-3), for loading into."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self._state_module())

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint(), into the sharded model

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._at_exception.skip(self):
            return {}
        return get_optimizer_state_dict(self._state_module(), optimizer, options=StateDictOptions(cpu_offload=True))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint()

    def _callbacks(self) -> list[Any]:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return list(trainer.callbacks) if trainer is not None else []

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("AmpZeroStrategy.save_checkpoint does not take storage_options: it writes a sharded directory.")
        if self._at_exception.skip(self):
            return  # said on this rank: [Note: a checkpoint at an exception] in checkpoint/at_exception.py
        path = Path(self.broadcast(filepath))
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        # [Note: the averaged copy in a sharded checkpoint] in zero/averaged.py
        state.update(pop_averaged_states(self._callbacks(), checkpoint))
        try:
            save_sharded(path, state, checkpoint, is_global_zero=self.is_global_zero, barrier=self.barrier)
        finally:
            # [offload] map swapped parameters afresh: the pages the save read leave with the old map.
            after_checkpoint(self.model)()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        assert self.lightning_module is not None
        # Optimizer states only for a fit: trainer.test(ckpt_path="best") after fit still has the fit's
        # optimizers, and a weights-only checkpoint was refused there (a new-user trial; Lightning's
        # strategies restore optimizers only when fitting, too).
        trainer = self.lightning_module._trainer
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        try:
            if not fitting and path.is_file():
                # validate / test / predict from one file (Lightning's ddp, a consolidated --format lightning
                # file): weights only, as Lightning's own strategies read it there. Refused before (a
                # new-user trial); a fit from one file still is (its optimizer and loop states would not
                # carry over).
                return load_full_file(path, self._state_module(), strict=self.lightning_module.strict_loading,
                                      weights_only=weights_only)
            optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else []
            callbacks = self._callbacks()
            checkpoint, loaded = load_sharded(path, self._state_module(), optimizers,
                                              strict=self.lightning_module.strict_loading, weights_only=weights_only,
                                              extra=averaged_targets(callbacks, self._model_state))
            if self.is_global_zero:
                self._say_once(interrupted_saves_note(path.parent, beside=path.name))
            restore_averaged_states(callbacks, checkpoint, loaded, self._model_state)
            return checkpoint
        finally:
            # [offload] the load wrote swapped parameters through the file's memory map: forget copies read
            # ahead, drop the pages it touched.
            after_checkpoint(self.model)()

    def save_consolidated(self, path: Any, dtype: Optional[str] = "bf16", fmt: Optional[str] = None,
                          max_shard_size: Any = None) -> list[Path]:
        """Write the whole model (e.g. 16-bit weights at the end of training) as plain state-dict file(s).

        Collective (call it on every rank); each parameter is gathered alone, so no rank holds the
        whole model. Loads with ``load_state_dict`` into the unwrapped LightningModule. ``fmt``
        ("safetensors" or "pt") defaults to what ``path``'s suffix names (``.pt``, ``.pth``,
        ``.bin``: ``torch.save``), else safetensors; ``dtype`` None keeps the parameters' own.
        """
        from lightning_ampzero.checkpoint.consolidate import export_consolidated

        try:
            return export_consolidated(self._state_module(), Path(self.broadcast(str(path))), dtype=dtype, fmt=fmt,
                                       max_shard_size=max_shard_size, is_global_zero=self.is_global_zero)
        finally:
            after_checkpoint(self.model)()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                remove_checkpoint_dir(path)
            elif path.exists():
                path.unlink()


AmpZeroStrategy.__init__.__signature__ = _keyword_signature(AmpZeroStrategy.__init__)  # type: ignore[attr-defined]
