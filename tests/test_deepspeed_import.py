"""DeepSpeed JSON import: conversion, errors, warnings, Trainer/optimizer wiring, Hydra output.

The five configs in examples/deepspeed_migration/ds_configs are the shapes of the public
tutorials (ZeRO-1 + WarmupDecayLR + fp16; ZeRO-R activation checkpointing; ZeRO-3 CPU offload;
ZeRO-3 Infinity with nvme, aio and "auto"; fp16 auto_cast with an Adam section). The last test
trains each of them on 2 CPU processes (in a subprocess: Lightning's launcher must not re-run
pytest).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lightning_ampzero.cli.config import main as config_main
from lightning_ampzero.config import (
    ActivationCheckpointingConfig,
    Fp8Config,
    LossScalerConfig,
    OffloadConfig,
    ZeroConfig,
)
from lightning_ampzero.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedConfigWarning,
    SchedulerConfig,
    WarmupDecayLR,
    build_scheduler,
    convert_deepspeed_config,
)

from _scripts import script_env  # noqa: E402  (tests/ is on the path, as for the other test files)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "deepspeed_migration" / "ds_configs"
EXAMPLE = REPO / "examples" / "deepspeed_migration" / "train_with_ds_config.py"


def _convert(data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return convert_deepspeed_config(data, **kw)


# ---------------------------------------------------------------------------------------
# The five tutorial configs
# ---------------------------------------------------------------------------------------


def test_zero1_fp16_warmupdecay():
    r = _convert(CONFIGS / "zero1_fp16_warmupdecay.json")
    assert r.config.zero.stage == 1
    assert r.config.zero.reduce_bucket_size == r.config.zero.allgather_bucket_size == 5e7
    assert r.config.precision.precision == "16-mixed"
    assert r.config.precision.loss_scaler == LossScalerConfig(initial_scale_power=15, loss_scale_window=500)
    assert r.trainer == {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm", "accumulate_grad_batches": 1}
    assert (r.micro_batch_size, r.train_batch_size) == (4, 8)
    assert r.optimizer.type == "AdamW"  # DeepSpeed's "Adam" with adam_w_mode (default true)
    assert r.optimizer.betas == (0.8, 0.999) and r.optimizer.weight_decay == 3e-7
    assert r.scheduler == SchedulerConfig(type="WarmupDecayLR", warmup_min_lr=0, warmup_max_lr=0.002,
                                          warmup_num_steps=5, total_num_steps=100)


def test_zero_r_activation_checkpointing_turns_on_full_checkpointing():
    r = _convert(CONFIGS / "zero_r_activation_checkpointing.json")
    assert r.config.zero.stage == 2 and r.config.precision.precision is None
    # The section's settings, with full checkpointing of the repeated blocks (a note says so).
    assert r.config.activation_checkpointing == ActivationCheckpointingConfig(
        mode="full", number_checkpoints=4, cpu_checkpointing=True, contiguous_memory_optimization=True)
    assert "deepspeed.checkpointing.checkpoint" in dict(r.notes)["activation_checkpointing"]
    # Splitting checkpoints across tensor-parallel ranks saves nothing on a data-parallel mesh.
    assert "activation_checkpointing.partition_activations" in dict(r.no_effect)
    assert "activation_checkpointing" not in dict(r.no_effect)


def test_zero3_cpu_offload():
    r = _convert(CONFIGS / "zero3_cpu_offload.json")
    z = r.config.zero
    assert (z.stage, z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (3, 1e6, 1e6, 1e4)
    assert z.max_reuse_distance == 1e9  # stage3_max_reuse_distance ([Note: reuse distance] in zero/units.py)
    assert r.trainer["accumulate_grad_batches"] == 2
    assert r.scheduler.type == "WarmupLR" and r.scheduler.total_num_steps is None
    assert r.config.offload == OffloadConfig(offload_optimizer="cpu", offload_param="cpu", pin_memory=True,
                                             sub_group_size=1e9)
    no_effect = dict(r.no_effect)
    assert "zero_optimization.stage3_max_live_parameters" in no_effect
    assert not [k for k in no_effect if "offload" in k or "sub_group_size" in k]


def test_zero3_infinity_auto_values_take_defaults():
    r = _convert(CONFIGS / "zero3_infinity_nvme_auto.json")
    # every size was "auto"; the reuse distance is the config's own 1e9
    assert r.config.zero == ZeroConfig(stage=3, max_reuse_distance=1e9)
    assert r.config.precision.precision is None  # fp16/bf16 "auto": the Trainer decides
    assert r.trainer == {} and r.micro_batch_size is None
    for key in ("gradient_accumulation_steps", "zero_optimization.reduce_bucket_size", "optimizer.params.lr",
                "fp16.enabled", "scheduler.params.warmup_max_lr"):
        assert key in r.auto
    assert r.optimizer_auto == ("lr", "betas", "eps", "weight_decay")
    assert r.scheduler.warmup_max_lr is None  # = the optimizer's lr
    # ZeRO-Infinity: optimizer state and parameters to NVMe with their buffers (the parameters'
    # buffer_count/buffer_size are DeepSpeed's defaults, 5 and 1e8) and aio's thread count.
    assert r.config.offload == OffloadConfig(offload_optimizer="nvme", offload_param="nvme", nvme_path="/local_nvme",
                                             buffer_count=4, sub_group_size=1e9, io_threads=1, param_buffer_count=5,
                                             param_buffer_size=1e8)
    assert "zero_optimization.offload_param.device" not in dict(r.notes)
    no_effect = dict(r.no_effect)
    assert "aio.block_size/queue_depth/overlap_events" in no_effect
    assert "param_buffer_count buffers" in no_effect["zero_optimization.offload_param.max_in_cpu"]
    assert not [k for k in no_effect if k.startswith("zero_optimization.offload_param.") and "max_in_cpu" not in k]


def test_fp16_auto_cast_with_adam_section():
    r = _convert(CONFIGS / "fp16_autocast_adam.json")
    assert r.config.precision.precision == "16-mixed"
    assert r.config.precision.loss_scaler.consecutive_hysteresis is True
    assert r.config.precision.loss_scaler.initial_scale_power == 12
    assert r.optimizer.type == "AdamW" and r.optimizer.weight_decay == 0.1
    assert "optimizer.params.torch_adam" in dict(r.no_effect)
    # auto_cast (DeepSpeed's casting of an fp16 model's inputs) is listed, not silently dropped
    assert "torch autocast casts each op's inputs" in dict(r.no_effect)["fp16.auto_cast"]


# ---------------------------------------------------------------------------------------
# Feature sections: offload, aio, activation_checkpointing, msamp
# ---------------------------------------------------------------------------------------


def test_indexing_the_config_as_deepspeeds_dict_says_where_the_section_went():
    # Lightning's DeepSpeedStrategy.config is DeepSpeed's dict; ours is a dataclass. A migrating user's
    # config["zero_optimization"] is told which field holds that section, and how to get a dict.
    config = _convert(CONFIGS / "zero3_cpu_offload.json").config
    with pytest.raises(TypeError, match=r"'zero_optimization' section is read as strategy\.config\.zero\."):
        config["zero_optimization"]
    with pytest.raises(TypeError, match=r"not DeepSpeed's dict.*dataclasses\.asdict") as caught:
        config["train_batch_size"]
    assert "section is read as" not in str(caught.value)  # no invented mapping for a key with no section here
    assert dataclasses.asdict(config)["zero"]["stage"] == config.zero.stage == 3


def test_offload_sections_map_to_offload_config():
    r = _convert({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False,
                                                                           "nvme_path": "/unused", "ratio": 0.5}}})
    assert r.config.offload == OffloadConfig(offload_optimizer="cpu", pin_memory=False)
    no_effect = dict(r.no_effect)
    assert "only used with device 'nvme'" in no_effect["zero_optimization.offload_optimizer.nvme_path"]
    assert "partial offload" in no_effect["zero_optimization.offload_optimizer.ratio"]
    # DeepSpeed's legacy spelling of the same switches.
    legacy = _convert({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                                             "cpu_offload_use_pin_memory": False}})
    assert legacy.config.offload == OffloadConfig(offload_optimizer="cpu", offload_param="cpu", pin_memory=False)
    # Without optimizer offload, sub_group_size and aio change nothing: listed, not set.
    plain = _convert({"zero_optimization": {"stage": 3, "sub_group_size": 1e9}, "aio": {"thread_count": 4}})
    assert plain.config.offload == OffloadConfig()
    assert {"zero_optimization.sub_group_size", "aio"} <= set(dict(plain.no_effect))


def test_offload_param_nvme_keys_are_imported():
    """ZeRO-Infinity's offload_param section: device, nvme_path, buffer_count, buffer_size become the
    parameter swapping's settings; aio tunes it even with the optimizer state in host memory."""
    r = _convert({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "nvme", "nvme_path": "/swap", "buffer_count": 3,
                                                          "buffer_size": 2e6, "max_in_cpu": 1e9}},
                  "aio": {"thread_count": 4, "queue_depth": 8}})
    assert r.config.offload == OffloadConfig(offload_optimizer="cpu", offload_param="nvme", nvme_path="/swap",
                                             param_buffer_count=3, param_buffer_size=2e6, io_threads=4)
    no_effect = dict(r.no_effect)
    assert set(no_effect) == {"zero_optimization.offload_param.max_in_cpu", "aio.queue_depth"}
    assert "no libaio queue" in no_effect["aio.queue_depth"]
    # With device 'cpu' the NVMe-only keys are listed as having no effect, not set.
    cpu = _convert({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                          "offload_param": {"device": "cpu", "nvme_path": "/swap", "buffer_size": 2e6,
                                                            "max_in_cpu": 1e9}}})
    assert cpu.config.offload == OffloadConfig(offload_optimizer="cpu", offload_param="cpu")
    assert {f"zero_optimization.offload_param.{k}" for k in ("nvme_path", "buffer_size", "max_in_cpu")} <= set(
        dict(cpu.no_effect))


@pytest.mark.parametrize(("data", "match"), [
    # One directory for both swap files: two different ones are a contradiction, named.
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                            "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
     "offload_param.nvme_path='/b' contradicts zero_optimization.offload_optimizer.nvme_path='/a'"),
    # Parameters on NVMe need the host optimizer step (it writes them into their swap file).
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"}}},
     "needs offload_optimizer='cpu' or 'nvme'"),
])
def test_offload_param_nvme_errors(data, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        convert_deepspeed_config(data, warn=False)


def test_msamp_section_turns_on_fp8():
    r = _convert({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                  "msamp": {"enabled": True, "opt_level": "O2"}})
    assert r.config.fp8 == Fp8Config(msamp="O2")
    assert r.config.precision.precision == "bf16-mixed"
    assert "msamp" in dict(r.notes)
    assert r.hydra_groups()["fp8"] == "tensorwise" and "fp8.msamp=O2" in r.hydra_overrides()
    assert _convert({"msamp": {"enabled": False, "opt_level": "O2"}}).config.fp8 == Fp8Config.off()


def test_feature_sections_take_effect_in_the_strategy():
    from lightning_ampzero.strategy import AmpZeroStrategy

    with pytest.warns(DeepSpeedConfigWarning, match="turns on full checkpointing"):
        s = AmpZeroStrategy(config={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                    "activation_checkpointing": {"cpu_checkpointing": True}})
    assert s.config.offload.offload_optimizer == "cpu"
    assert s.config.activation_checkpointing == ActivationCheckpointingConfig(mode="full", cpu_checkpointing=True)


# ---------------------------------------------------------------------------------------
# Errors and the warning
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_sizee": 5}},
         "zero_optimization.reduce_bucket_sizee (did you mean 'reduce_bucket_size'?)"),
        ({"gradient_clipings": 1.0}, "gradient_clipings (did you mean 'gradient_clipping'?)"),
        ({"fp16": {"enabled": True, "initial_scale_pow": 8}}, "fp16.initial_scale_pow (did you mean 'initial_scale_power'?)"),
        ({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memroy": True}}},
         "zero_optimization.offload_param.pin_memroy (did you mean 'pin_memory'?)"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}},
         "scheduler.params.warmup_num_step (did you mean 'warmup_num_steps'?)"),
    ],
)
def test_unknown_keys_fail_with_path_and_suggestion(config, expected):
    with pytest.raises(DeepSpeedConfigError) as info:
        _convert(config)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"zero_optimization": {"stage": 4}}, "Allowed values: 0"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
         "fp16.enabled and bf16.enabled are both set: enable one precision"),
        ({"communication_data_type": "int8"}, "Allowed values: fp32, fp16, bf16"),
        ({"optimizer": {"type": "Adamm", "params": {}}}, "Allowed values: 'Adam', 'AdamW'"),
        ({"scheduler": {"type": "WarmupDecayLRR", "params": {}}},
         "scheduler.type='WarmupDecayLRR' is not supported. Allowed values: 'WarmupLR', 'WarmupDecayLR'."),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "'none', 'cpu', 'nvme'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a whole number >= 1"),
        ({"msamp": {"enabled": True, "opt_level": "O3"}}, "Allowed values: 'O1', 'O2'"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
         "needs zero.stage 1, 2 or 3"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs zero.stage=3"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                                  "buffer_count": 2}}},
         "offload.buffer_count must be >= 3, got 2. (from the DeepSpeed keys"
         " zero_optimization.offload_optimizer.buffer_count)"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "cpu", "pin_memory": False}}}, "one setting for both"),
        ({"activation_checkpointing": {"number_checkpoints": 0}},
         "activation_checkpointing.number_checkpoints must be >= 1"),
        # was a bare OverflowError in the workers
        ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "(from the DeepSpeed keys fp16.initial_scale_power)"),
    ],
)
def test_bad_values_fail_naming_the_allowed_ones(config, expected):
    with pytest.raises(DeepSpeedConfigError, match="cannot be converted") as info:
        _convert(config)
    assert expected in str(info.value)


def test_duplicate_json_keys_are_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 2.0}')
    with pytest.raises(DeepSpeedConfigError, match="appears twice"):
        convert_deepspeed_config(path)


def test_no_effect_keys_are_listed_in_exactly_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_deepspeed_config(CONFIGS / "zero3_cpu_offload.json")
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) == 1
    message = str(ours[0].message)
    assert "zero_optimization.stage3_max_live_parameters" in message
    assert "zero_optimization.overlap_comm" not in message  # mapped: it acts at stage 3 on gloo
    assert "zero_optimization.offload" not in message  # mapped: offload_optimizer / offload_param take effect
    assert "zero_optimization.stage" + " " not in message  # mapped keys are not listed


def test_no_warning_when_every_key_takes_effect():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_deepspeed_config({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0})
    assert not [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]


# ---------------------------------------------------------------------------------------
# The scheduler reproduces DeepSpeed's arithmetic
# ---------------------------------------------------------------------------------------


def _deepspeed_gamma(i: int, warmup: int, total, kind: str) -> float:
    warmup = max(2, warmup)
    if i < warmup:
        return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup
    return 1.0 if total is None else max(0.0, (total - i) / max(1.0, total - warmup))


@pytest.mark.parametrize(("kind", "total"), [("log", None), ("log", 20), ("linear", 20)])
def test_warmup_schedules_match_deepspeed(kind, total):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = WarmupDecayLR(opt, 0.1, 1.0, 5, kind, total)
    seen = []
    for _ in range(25):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # DeepSpeed: optimizer step k runs after k scheduler steps, at iteration k - 1 (min lr for k = 0).
    expected = [0.1] + [0.1 + 0.9 * _deepspeed_gamma(k - 1, 5, total, kind) for k in range(1, 25)]
    assert seen == pytest.approx(expected)


def test_warmup_decay_needs_a_total():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler(SchedulerConfig(type="WarmupDecayLR"), opt, lr=1.0, total_steps=None)
    assert build_scheduler(SchedulerConfig(type="WarmupDecayLR"), opt, lr=1.0, total_steps=50).total_num_steps == 50
    # each is the class the config names (a WarmupLR showed up as a WarmupDecayLR object)
    assert type(build_scheduler(SchedulerConfig(type="WarmupDecayLR"), opt, lr=1.0, total_steps=50)).__name__ \
        == "WarmupDecayLR"
    assert type(build_scheduler(SchedulerConfig(type="WarmupLR"), opt, lr=1.0)).__name__ == "WarmupLR"


# ---------------------------------------------------------------------------------------
# Trainer and optimizer wiring
# ---------------------------------------------------------------------------------------


def _fake_trainer(**kw):
    base = dict(gradient_clip_val=None, gradient_clip_algorithm="norm", accumulate_grad_batches=1,
                precision="32-true", world_size=2, lightning_module=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_apply_to_trainer_sets_unset_values():
    r = _convert(CONFIGS / "zero3_cpu_offload.json")
    trainer = _fake_trainer()
    r.apply_to_trainer(trainer)
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm, trainer.accumulate_grad_batches) == (1.0, "norm", 2)


def test_apply_to_trainer_keeps_explicit_trainer_values_and_warns():
    r = _convert(CONFIGS / "zero3_cpu_offload.json")
    trainer = _fake_trainer(gradient_clip_val=0.5, accumulate_grad_batches=4)
    with pytest.warns(DeepSpeedConfigWarning) as caught:
        r.apply_to_trainer(trainer)
    assert (trainer.gradient_clip_val, trainer.accumulate_grad_batches) == (0.5, 4)
    text = " ".join(str(w.message) for w in caught)
    assert "gradient_clipping=1.0" in text and "gradient_accumulation_steps=2" in text


def test_apply_to_trainer_checks_the_batch_arithmetic():
    r = _convert(CONFIGS / "zero1_fp16_warmupdecay.json")  # 8 = 4 x 1 x 2
    r.apply_to_trainer(_fake_trainer(world_size=2))
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size=8 must equal.* = 16\. Set train_batch_size to 16,"
                                                   r" or leave it out"):
        r.apply_to_trainer(_fake_trainer(world_size=4))
    assert r.micro_batch(2) == 4
    only_total = _convert({"train_batch_size": 32, "gradient_accumulation_steps": 2})
    assert only_total.micro_batch(4) == 4


def _bare_module(lr=0.01):
    import lightning.pytorch as pl

    class Bare(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lr = lr
            self.layer = torch.nn.Linear(4, 4)

    return Bare()


def test_optimizer_sections_stand_in_for_a_missing_configure_optimizers():
    from lightning.pytorch.utilities.model_helpers import is_overridden

    r = _convert(CONFIGS / "zero1_fp16_warmupdecay.json")
    module = _bare_module()
    assert not is_overridden("configure_optimizers", module)
    r.install_optimizers(module)
    r.install_optimizers(module)  # idempotent
    assert is_overridden("configure_optimizers", module)  # Lightning's check now passes
    module.trainer = SimpleNamespace(estimated_stepping_batches=100)  # type: ignore[assignment]
    out = r.configure_optimizers(module, module.trainer)
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.8, 0.999)
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 100
    assert out["lr_scheduler"]["interval"] == "step"


def test_auto_lr_comes_from_the_module():
    r = _convert(CONFIGS / "zero3_infinity_nvme_auto.json")
    module = _bare_module(lr=0.0123)
    out = r.configure_optimizers(module, SimpleNamespace(estimated_stepping_batches=10))
    assert out["optimizer"].defaults["lr"] == 0.0123
    assert out["lr_scheduler"]["scheduler"].max_lrs == [0.0123]


def _own_optimizer_module(with_scheduler: bool = False):
    import lightning.pytorch as pl

    class Own(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)
            self.lrs: list[float] = []

        def training_step(self, batch, batch_idx):
            self.lrs.append(self.optimizers().param_groups[0]["lr"])
            return self.layer(batch).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            if with_scheduler:
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]
            return opt

    return Own()


def test_a_module_with_its_own_optimizer_gets_the_config_scheduler_as_in_deepspeed():
    # deepspeed.initialize(model, optimizer=client_opt, config=...) with a scheduler section: DeepSpeed
    # keeps the client optimizer and steps the configured scheduler on it (the tutorial's pattern).
    r = _convert(CONFIGS / "zero1_fp16_warmupdecay.json")
    module = _own_optimizer_module()
    module.trainer = SimpleNamespace(estimated_stepping_batches=7)  # type: ignore[assignment]
    r.install_optimizers(module)
    with pytest.warns(DeepSpeedConfigWarning, match="optimizer section is ignored"):
        out = module.configure_optimizers()
    assert isinstance(out["optimizer"], torch.optim.SGD)
    sched = out["lr_scheduler"]["scheduler"]
    assert isinstance(sched, WarmupDecayLR) and out["lr_scheduler"]["interval"] == "step"
    assert sched.max_lrs == [0.002] and sched.total_num_steps == 100  # the section's values, not the client's lr


def test_another_deepspeed_optimizer_is_ignored_beside_the_modules_own_and_refused_without_it():
    # [Note: a DeepSpeed optimizer we do not build]. Before: Lamb's own params (max_coeff) were
    # refused as unknown keys, a message about typos, before its type was read (a new-user trial).
    cfg = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3, "min_coeff": 0.01}},
           "zero_optimization": {"stage": 2}}
    r = convert_deepspeed_config(cfg)
    assert r.optimizer is None and "optimizer.type='Lamb' (a DeepSpeed optimizer) is not built here" in \
        r.unsupported_optimizer
    module = _own_optimizer_module()
    module.trainer = SimpleNamespace(estimated_stepping_batches=7)  # type: ignore[assignment]
    r.install_optimizers(module)
    with pytest.warns(DeepSpeedConfigWarning, match="optimizer section is ignored"):
        assert isinstance(module.configure_optimizers(), torch.optim.SGD)
    with pytest.raises(DeepSpeedConfigError, match="configures no optimizer, and the config's optimizer.type='Lamb'"):
        r.configure_optimizers(_bare_module())
    assert "(e.g. timm.optim.Lamb)" in r.unsupported_optimizer
    # each names what to configure instead: not Lamb for SGD (a trial)
    sgd = convert_deepspeed_config({"optimizer": {"type": "SGD"}}).unsupported_optimizer
    assert "(torch.optim.SGD)" in sgd and "'SGD' (a torch optimizer)" in sgd  # not "a DeepSpeed optimizer"
    with pytest.raises(DeepSpeedConfigError, match=r"configure torch.optim.AdamW\(..., amsgrad=True\) in the"):
        convert_deepspeed_config({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}})
    # any other torch.optim class, which DeepSpeed builds by its name, as well (it was an error beside the module's)
    rms = convert_deepspeed_config({"optimizer": {"type": "RMSprop", "params": {"alpha": 0.9}}})
    assert rms.optimizer is None and "(torch.optim.RMSprop)" in rms.unsupported_optimizer
    with pytest.raises(DeepSpeedConfigError, match="remove the optimizer section"):
        r.hydra_values(2)
    # A name DeepSpeed does not know stays an error, with a suggestion.
    with pytest.raises(DeepSpeedConfigError, match="optimizer.type='AdamWW' is not supported.*AdamW"):
        convert_deepspeed_config({"optimizer": {"type": "AdamWW"}})


@pytest.mark.parametrize("own_scheduler", [False, True])
def test_own_optimizer_with_config_scheduler_follows_deepspeeds_lr_sequence(tmp_path, own_scheduler):
    """The section steps the module's optimizer; a scheduler of the module's own wins over it.

    DeepSpeed 0.15 and later (its PR 5846) and Lightning's DeepSpeedStrategy keep a client
    scheduler; before, the section replaced it here, and a trial's StepLR ran as WarmupLR.
    """
    import lightning.pytorch as pl

    r = _convert({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 4, "total_num_steps": 10}}})
    module = _own_optimizer_module(with_scheduler=own_scheduler)
    r.install_optimizers(module)
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(12, 2), batch_size=1))
    said = [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert any("scheduler section is ignored" in m for m in said) == own_scheduler
    if own_scheduler:  # the module's StepLR(step_size=1, gamma=0.1), stepped per epoch: one epoch of 12 steps
        assert module.lrs == pytest.approx([0.1] * 12)
        return
    expected = [0.01] + [0.01 + 0.49 * _deepspeed_gamma(k - 1, 4, 10, "log") for k in range(1, 12)]
    assert module.lrs == pytest.approx(expected)
    assert module.lrs[5] == pytest.approx(0.5) and module.lrs[11] == pytest.approx(0.01)  # decayed to min at 10


def test_a_dataloader_batch_other_than_the_configs_micro_batch_is_said_when_training_starts(tmp_path):
    # A plain Trainer script (a process of its own: the strategy starts a process group).
    code = textwrap.dedent("""
        import json, sys, warnings
        import torch, lightning.pytorch as pl
        from lightning_ampzero.strategy import AmpZeroStrategy

        class Own(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 2)
            def training_step(self, batch, batch_idx):
                return self.layer(batch).sum()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        said = {}
        for batch in (4, 8):
            trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                                 strategy=AmpZeroStrategy(config={"train_micro_batch_size_per_gpu": 8}))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(Own(), torch.utils.data.DataLoader(torch.randn(16, 2), batch_size=batch))
            said[batch] = [str(w.message) for w in caught if w.category.__name__ == "DeepSpeedConfigWarning"]
        print(json.dumps(said))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=script_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(said["4"]) == 1 and "DataLoader's batch_size is 4" in said["4"][0] and "batch_size=8" in said["4"][0]
    assert "= 4 samples, where the config has 8" in said["4"][0]
    assert "train_micro_batch_size_per_gpu=8 makes 8 samples per process" in said["4"][0]
    assert said["8"] == []


def test_strategy_accepts_a_deepspeed_dict_and_path():
    from lightning_ampzero.strategy import AmpZeroStrategy

    s = AmpZeroStrategy(config={"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6}})
    assert s.config.zero.stage == 3 and s.config.zero.reduce_bucket_size == 1e6
    assert s.imported is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        s = AmpZeroStrategy(config=str(CONFIGS / "fp16_autocast_adam.json"))
    assert s.config.precision.precision == "16-mixed" and s.config.zero.stage == 2


# ---------------------------------------------------------------------------------------
# Hydra: overrides and experiment YAML compose into the same config
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_hydra_overrides_compose_to_the_same_strategy_config(name):
    from lightning_ampzero.train import compose_typed

    r = _convert(CONFIGS / name)
    app = compose_typed(r.hydra_overrides(world_size=2))
    assert app.strategy == r.config.zero
    expected_precision = r.config.precision.precision or "32-true"  # "auto": the app's default group
    assert app.precision.precision == expected_precision
    assert app.precision.loss_scaler == r.config.precision.loss_scaler
    if r.optimizer is not None:
        assert app.optim.type == r.optimizer.type
        if "lr" not in r.optimizer_auto:
            assert app.optim.lr == r.optimizer.lr
    if r.micro_batch(2) is not None:
        assert app.data.batch_size == r.micro_batch(2)
    if "gradient_clip_val" in r.trainer:
        assert app.trainer.gradient_clip_val == r.trainer["gradient_clip_val"]
    assert (app.offload, app.activation_checkpointing, app.fp8) == (
        r.config.offload, r.config.activation_checkpointing, r.config.fp8)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_hydra_yaml_composes_to_the_same_strategy_config(name, tmp_path):
    from lightning_ampzero.train import compose_typed

    r = _convert(CONFIGS / name)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "ds.yaml").write_text(r.hydra_yaml("ds", world_size=2))
    app = compose_typed(["experiment=ds"], config_dir=str(tmp_path))
    expected = r.config
    if expected.precision.precision is None:  # "auto": the app's default precision group
        expected = dataclasses.replace(expected, precision=dataclasses.replace(expected.precision, precision="32-true"))
    assert app.amp_config == expected


def test_cli_prints_overrides_and_yaml_that_composes(tmp_path, capsys):
    from lightning_ampzero.train import compose_typed

    path = CONFIGS / "zero1_fp16_warmupdecay.json"
    assert config_main(["from-deepspeed", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ampzero-train strategy=zero1 precision=16-mixed ")
    assert "no effect: steps_per_print" in out.err
    # Stage 1: overlap_comm=true takes effect and is the default, so neither listed nor written.
    assert "overlap_comm" not in out.err and "overlap_comm" not in out.out
    # "auto" means ampzero-train's default for these overrides, but the user's own settings in a script
    assert config_main(["from-deepspeed", str(CONFIGS / "zero3_infinity_nvme_auto.json")]) == 0
    err = capsys.readouterr().err
    assert "\"auto\": " in err and "with AmpZeroStrategy(config=...) in a script, the Trainer's" in err
    assert config_main(["from-deepspeed", str(path), "--yaml", "--name", "ds"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["defaults"] == [{"override /strategy": "zero1"}, {"override /precision": "16-mixed"}]
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "ds.yaml").write_text(text)
    app = compose_typed(["experiment=ds"], config_dir=str(tmp_path))
    r = _convert(path)
    assert app.strategy == r.config.zero and app.precision.loss_scaler == r.config.precision.loss_scaler
    assert app.scheduler == r.scheduler and app.data.batch_size == 4


def test_cli_reports_unknown_keys(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stagee": 2}}))
    assert config_main(["from-deepspeed", str(path)]) == 2
    assert "zero_optimization.stagee (did you mean 'stage'?)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# The configs train (acceptance 3)
# ---------------------------------------------------------------------------------------


def _train(configs: list[Path], tmp_path: Path, steps: int = 6, extra: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, configs), "--steps", str(steps), "--out", str(out), *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_fp32_tutorial_configs_train_on_two_processes(tmp_path):
    names = ["zero_r_activation_checkpointing.json", "zero3_cpu_offload.json", "zero3_infinity_nvme_auto.json"]
    nvme = tmp_path / "nvme"  # the Infinity config's nvme_path (/local_nvme) does not exist here
    nvme.mkdir()
    results = _train([CONFIGS / n for n in names], tmp_path, extra=("--nvme-path", str(nvme)))
    for name in names:
        r = results[str(CONFIGS / name)]
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["optimizer"] == "AdamW"  # from the config's optimizer section
        assert r["optimizer_steps"] == 6 and r["losses"][-1] < r["losses"][0]
    # The features ran: the blocks were checkpointed, the optimizer stepped offloaded.
    zero_r = results[str(CONFIGS / "zero_r_activation_checkpointing.json")]
    assert zero_r["checkpointed_blocks"] == ["model.blocks.0", "model.blocks.1"] and zero_r["lr_schedulers"] == []
    offload = results[str(CONFIGS / "zero3_cpu_offload.json")]
    assert offload["stage"] == 3 and offload["accumulate_grad_batches"] == 2 and offload["gradient_clip_val"] == 1.0
    assert offload["lr_schedulers"] == ["WarmupLR"]  # the section's type
    assert offload["optimizer_wrapper"] == "OffloadedAdam" and offload["offload"]["optimizer"] == "cpu"
    infinity = results[str(CONFIGS / "zero3_infinity_nvme_auto.json")]
    assert infinity["optimizer_wrapper"] == "OffloadedAdam"
    assert infinity["offload"] == {"optimizer": "nvme", "param": "nvme", "nvme_path": str(nvme)}
    assert list(nvme.iterdir()) == []  # the swap files were deleted at teardown


def test_fp16_tutorial_configs_train_on_two_processes(tmp_path):
    names = ["zero1_fp16_warmupdecay.json", "fp16_autocast_adam.json"]
    results = _train([CONFIGS / n for n in names], tmp_path)
    for name in names:
        r = results[str(CONFIGS / name)]
        if "error" in r and "not available" in r["error"] and "yet" in r["error"]:
            pytest.xfail(f"{name}: {r['error']}")
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["precision"] == "16-mixed" and r["optimizer"] == "AdamW"
        assert r["losses"][-1] < r["losses"][0]
    assert results[str(CONFIGS / "zero1_fp16_warmupdecay.json")]["stage"] == 1


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_an_auto_fp16_section_scales_as_written_when_the_run_is_fp16(precision, tmp_path):
    """fp16.enabled "auto" (Hugging Face's configs): its loss-scaler values were dropped under 16-mixed.

    A new-user trial's config (initial_scale_power 8, loss_scale_window 3, hysteresis 1) trained with
    the defaults (16, 1000, 2) while the log said fp16 was on. They now hold when the Trainer's
    precision is fp16, and are left out (not refused) when it is not.
    """
    import lightning.pytorch as pl

    from lightning_ampzero import AmpZeroStrategy
    from lightning_ampzero.config import LossScalerConfig

    config = {"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 3,
                       "hysteresis": 1, "min_loss_scale": "auto"}, "zero_optimization": {"stage": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, precision=precision,
                             strategy=AmpZeroStrategy(config=config))
    scaler = trainer.precision_plugin.config.loss_scaler
    if precision == "16-mixed":
        assert scaler == LossScalerConfig(initial_scale_power=8, loss_scale_window=3, hysteresis=1)
        assert trainer.precision_plugin.scaler.get_scale() == 2.0 ** 8
    else:
        assert scaler == LossScalerConfig()
    imported = trainer.strategy.imported
    said = imported._auto_enabled("fp16.enabled", precision, scaler)
    assert said.startswith("true" if precision == "16-mixed" else "false")
    assert ("with the section's loss-scaler values" in said) == (precision == "16-mixed")
    if precision == "16-mixed":  # a loss scaler of the strategy's own wins, and the line says so
        said = imported._auto_enabled("fp16.enabled", precision, LossScalerConfig(initial_scale_power=10))
        assert said.endswith("the strategy's own loss scaler wins over the section's)")
    # ampzero-config names the values to add under 16-mixed (it printed nothing of them)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    err = subprocess.run([sys.executable, "-m", "lightning_ampzero.cli.config", "from-deepspeed", str(path)],
                         capture_output=True, text=True, env=script_env(), timeout=120).stderr
    assert "precision.loss_scaler.initial_scale_power=8 precision.loss_scaler.loss_scale_window=3" in err, err
    # a bad value in such a section is refused at conversion, as under "enabled": true
    with pytest.raises(DeepSpeedConfigError, match="hysteresis"):
        convert_deepspeed_config({"fp16": {"enabled": "auto", "hysteresis": 0}})


def test_disabled_fp16_section_with_scaler_keys_is_accepted():
    """Regression: fp16.enabled=false plus scaler keys used to crash on an internal marker."""
    from lightning_ampzero.deepspeed import convert_deepspeed_config

    converted = convert_deepspeed_config({"fp16": {"enabled": False, "loss_scale_window": 100},
                                          "zero_optimization": {"stage": 1}})
    assert converted.config.zero.stage == 1
    assert converted.config.precision.loss_scaler.loss_scale_window == 1000  # fp16 off: DeepSpeed ignores it too


# ---------------------------------------------------------------------------------------
# Migration fidelity: every key is mapped or named; misplaced keys say where they belong
# ---------------------------------------------------------------------------------------


def test_a_key_in_the_wrong_section_says_where_it_belongs():
    # The Hugging Face guide's ZeRO-Infinity config nests `aio` inside zero_optimization.
    with pytest.raises(DeepSpeedConfigError) as info:
        convert_deepspeed_config({"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}})
    message = str(info.value)
    assert "zero_optimization.aio (a DeepSpeed key that belongs at the top level of the config: move it there)" in message
    assert "ignore them silently" not in message  # DeepSpeed rejects it too (DeepSpeed issue 2721)
    with pytest.raises(DeepSpeedConfigError, match=r"stage \(a DeepSpeed key that belongs inside 'zero_optimization'"):
        convert_deepspeed_config({"stage": 2})


@pytest.mark.parametrize(
    ("section", "key", "reason"),
    [
        ({"stage": 0, "overlap_comm": True}, "zero_optimization.overlap_comm", "stage 0 is DDP"),
        ({"stage": 3, "stage3_max_live_parameters": 0}, "zero_optimization.stage3_max_live_parameters", "units in flight"),
        ({"stage": 2, "stage3_prefetch_bucket_size": 1e6}, "zero_optimization.stage3_prefetch_bucket_size",
         "a stage-3 setting, and the stage is 2"),
        ({"stage": 1, "stage3_param_persistence_threshold": 1e4}, "zero_optimization.stage3_param_persistence_threshold",
         "a stage-3 setting, and the stage is 1"),
        ({"stage": 2, "stage3_max_reuse_distance": 1e9}, "zero_optimization.stage3_max_reuse_distance",
         "a stage-3 setting, and the stage is 2"),
    ],
)
def test_falsy_and_stage3_only_keys_are_named_with_their_reason(section, key, reason):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert_deepspeed_config({"zero_optimization": section})
    assert reason in dict(result.no_effect)[key]
    assert any(key in str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning))


def test_cli_checks_the_batch_sizes_against_the_world_size(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 17, "train_micro_batch_size_per_gpu": 8}))
    assert config_main(["from-deepspeed", str(path), "--world-size", "2"]) != 0
    assert "train_batch_size=17 is not a multiple of train_micro_batch_size_per_gpu (8) x world size (2) = 16" \
           in capsys.readouterr().err
    path.write_text(json.dumps({"train_batch_size": 17, "train_micro_batch_size_per_gpu": 8,
                                "gradient_accumulation_steps": 1}))
    assert config_main(["from-deepspeed", str(path), "--world-size", "2"]) != 0
    assert "train_batch_size=17 must equal train_micro_batch_size_per_gpu (8) x gradient accumulation (1) x world" \
           " size (2) = 16" in capsys.readouterr().err
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}))
    assert config_main(["from-deepspeed", str(path), "--world-size", "2"]) == 0
    capsys.readouterr()


def test_cli_without_world_size_derives_the_batch_for_ampzero_trains_processes_and_says_so(tmp_path, capsys):
    # train_batch_size was dropped without a word when --world-size was not given: the run trained a
    # global batch of 4 where DeepSpeed trains 16 (a new-user trial)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": 2}}))
    assert config_main(["from-deepspeed", str(path)]) == 0
    out = capsys.readouterr()
    assert "trainer.accumulate_grad_batches=4 data.batch_size=2" in out.out  # 16 = 2 x 4 x 2 processes
    assert "train_batch_size=16: derived for ampzero-train's default 2 processes" in out.err
    assert config_main(["from-deepspeed", str(path), "--world-size", "4"]) == 0
    out = capsys.readouterr()
    assert "trainer.accumulate_grad_batches=2 data.batch_size=2" in out.out and "derived for" not in out.err
    path.write_text(json.dumps({"train_batch_size": 32}))
    assert config_main(["from-deepspeed", str(path), "--yaml"]) == 0
    assert "batch_size: 16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        config_main(["from-deepspeed", str(path), "--world-size", "0"])
    assert "must be at least 1" in capsys.readouterr().err
    assert config_main(["from-deepspeed", str(tmp_path)]) == 2
    assert "is a directory: give the JSON file in it" in capsys.readouterr().err


def test_two_batch_sizes_imply_the_accumulation_as_deepspeed_infers_it(capsys):
    # DeepSpeed takes any two of the three batch settings (a Megatron-DeepSpeed script's 8 and 2 on
    # 2 ranks was refused as "must equal 4": a new-user trial); accumulation = 8 / (2 x 2).
    cfg = convert_deepspeed_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                    "zero_optimization": {"stage": 2}})
    assert cfg.accumulation(2) == 2 and cfg.micro_batch(2) == 2
    assert cfg.hydra_values(2)["trainer"] == {"accumulate_grad_batches": 2}
    assert cfg.accumulation(4) == 1
    trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=1, gradient_clip_val=None,
                                    precision="32-true", lightning_module=None)
    cfg.apply_to_trainer(trainer)
    assert trainer.accumulate_grad_batches == 2
    # "auto" is the Trainer's: nothing inferred, and the sizes are checked against the Trainer's value.
    auto = convert_deepspeed_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                     "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}})
    assert auto.accumulation(2) == 1


def test_a_config_without_a_stage_is_deepspeeds_stage_0():
    # DeepSpeed's zero_optimization.stage defaults to 0 (no partitioning), with or without the section.
    assert convert_deepspeed_config({"gradient_clipping": 1.0}).config.zero.stage == 0
    assert convert_deepspeed_config({"zero_optimization": {"reduce_bucket_size": 1e6}}).config.zero.stage == 0
    assert convert_deepspeed_config({"zero_optimization": {"stage": 3}}).config.zero.stage == 3
    # said, as AmpZeroStrategy's own default is stage 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_deepspeed_config({"gradient_clipping": 1.0})
    assert any("zero_optimization.stage" in str(w.message) and "absent: stage 0" in str(w.message)
               for w in caught if issubclass(w.category, DeepSpeedConfigWarning))


def test_the_auto_values_are_listed_with_what_they_resolved_to():
    # "auto" took our default or the Trainer's / module's / DataLoader's value without a word: a user
    # migrating Hugging Face's config could not tell what `reduce_bucket_size: "auto"` had become.
    from lightning_ampzero._deepspeed.optim import build_scheduler

    r = _convert(CONFIGS / "zero3_infinity_nvme_auto.json")
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.0123, weight_decay=0.05)
    sched = build_scheduler(r.scheduler, opt, lr=0.0123)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[SimpleNamespace(scheduler=sched)],
                              accumulate_grad_batches=2, gradient_clip_val=None, world_size=2,
                              train_dataloader=SimpleNamespace(batch_size=4), precision="bf16-mixed")
    said = dict(line.split(" = ", 1) for line in r.auto_values(trainer, r.config))
    assert set(said) == set(r.auto)  # every "auto" key, once
    assert said["optimizer.params.lr"] == "0.0123 (the optimizer's)"
    assert said["optimizer.params.weight_decay"] == "0.05 (the optimizer's)"
    assert said["scheduler.params.warmup_max_lr"] == "0.0123 (the optimizer's lr)"
    assert said["scheduler.params.warmup_num_steps"].startswith(
        '0 ("auto" as Hugging Face fills it: no warmup steps; DeepSpeed warms up over at least 2')
    assert said["zero_optimization.reduce_bucket_size"] == f"{r.config.zero.reduce_bucket_size!r} (the default)"
    assert said["zero_optimization.stage3_prefetch_bucket_size"] == f"{r.config.zero.prefetch_bucket_size!r} (the default)"
    assert said["gradient_accumulation_steps"] == "2 (the Trainer's)"
    assert said["gradient_clipping"] == "no clipping (the Trainer's)"
    assert said["train_micro_batch_size_per_gpu"] == "4 (from the training DataLoader's batch_size)"
    assert said["train_batch_size"] == "16 (from the training DataLoader's batch_size)"  # 4 x 2 x 2
    assert said["fp16.enabled"] == "false ('bf16-mixed' is the precision in use)"  # not "'bf16-mixed'": a trial
    # the optimizer the section built: its "auto" values are the module's lr and our defaults, not "the optimizer's"
    built = r.configure_optimizers(_bare_module(lr=0.0123), SimpleNamespace(estimated_stepping_batches=10))
    trainer.optimizers = [built["optimizer"]]
    said = dict(line.split(" = ", 1) for line in r.auto_values(trainer, r.config))
    assert said["optimizer.params.lr"] == "0.0123 (the LightningModule's lr)"
    assert said["optimizer.params.weight_decay"].endswith(" (the default)")
    assert said["bf16.enabled"] == "true ('bf16-mixed' is the precision in use)"


def test_a_fit_logs_the_auto_values_it_resolved(tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning_ampzero import AmpZeroStrategy
        config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                  "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                             strategy=AmpZeroStrategy(config=config))
        trainer.fit(BoringModel(), torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=2))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=script_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if '"auto" values in this run' in line]
    assert len(said) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "zero_optimization.reduce_bucket_size = 500000000.0 (the default)" in said[0]
    assert "gradient_accumulation_steps = 1 (the Trainer's)" in said[0]
    assert "train_micro_batch_size_per_gpu = 2 (from the training DataLoader's batch_size)" in said[0]


def test_keys_deepspeed_itself_never_reads_are_listed_not_refused():
    # LLaMA-Factory's ds_z*_config.json templates carry comms_config / monitor_config (and an fp8
    # section), which DeepSpeed's parser skips: refused as misspellings, none of them imported.
    r = convert_deepspeed_config({"zero_optimization": {"stage": 2}, "comms_config": {"verbose": False},
                                  "monitor_config": {"enabled": True}, "fp8": {"enabled": True}})
    listed = dict(r.no_effect)
    assert set(listed) >= {"comms_config", "monitor_config", "fp8"}
    assert "AmpZeroStrategy(fp8=...)" in listed["fp8"] and not r.config.fp8.enabled
    with pytest.raises(DeepSpeedConfigError, match="comms_loger"):  # a misspelt key DeepSpeed reads is still refused
        convert_deepspeed_config({"comms_loger": {}})


def test_stage3_without_max_reuse_distance_takes_deepspeeds_default():
    # DeepSpeed's stage3_max_reuse_distance defaults to 1e9, AmpZeroStrategy's max_reuse_distance to 0.
    r = convert_deepspeed_config({"zero_optimization": {"stage": 3}})
    assert r.config.zero.max_reuse_distance == 1e9
    assert convert_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}}
                                    ).config.zero.max_reuse_distance == 0
    assert convert_deepspeed_config({"zero_optimization": {"stage": 2}}).config.zero.max_reuse_distance == 0


def test_a_bucket_size_of_zero_is_the_smallest_bucket_as_deepspeed_allows():
    # DeepSpeed's zero config takes reduce_bucket_size >= 0 (transformers' tests/deepspeed config has 0).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = convert_deepspeed_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0,
                                                            "allgather_bucket_size": 0}})
    assert r.config.zero.reduce_bucket_size == 1
    # (DeepSpeed's stage 3 does not read allgather_bucket_size: listed, not applied)
    assert "zero_optimization.allgather_bucket_size" in dict(r.no_effect)
    assert r.config.zero.allgather_bucket_size == ZeroConfig().allgather_bucket_size
    assert convert_deepspeed_config({"zero_optimization": {"stage": 2, "allgather_bucket_size": 0}}
                                    ).config.zero.allgather_bucket_size == 1
    assert any("0 read as 1 element" in str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning))
    with pytest.raises(DeepSpeedConfigError, match="reduce_bucket_size"):
        convert_deepspeed_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": -1}})


def test_the_deprecated_boolean_zero_optimization_is_read_as_deepspeed_reads_it():
    assert convert_deepspeed_config({"zero_optimization": True}).config.zero.stage == 1
    assert convert_deepspeed_config({"zero_optimization": False}).config.zero.stage == 0


def test_deepspeed_keys_refused_as_misspelt_by_a_migration_trial_are_taken():
    # fp32_allreduce and vocabulary_size are DeepSpeed top-level keys; cpu_offload_param is the spelling of
    # DeepSpeed's current ZeRO config model (the plural is its older one): all three stopped the import
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = convert_deepspeed_config({"fp32_allreduce": True, "vocabulary_size": 50257, "bf16": {"enabled": True},
                                      "zero_optimization": {"stage": 3, "cpu_offload_param": True}})
        assert r.config.precision.communication_data_type == "fp32"
        assert r.config.offload.offload_param == "cpu"
        assert "vocabulary_size" in dict(r.no_effect)
        r = convert_deepspeed_config({"fp32_allreduce": True, "communication_data_type": "bf16"})
        assert r.config.precision.communication_data_type == "bf16"  # the explicit one wins, as in DeepSpeed
        assert "communication_data_type is given" in dict(r.no_effect)["fp32_allreduce"]


@pytest.mark.parametrize("name", ["WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_another_deepspeed_scheduler_is_ignored_beside_the_modules_own_and_refused_without_it(name):
    # It was refused at construction even where the module's own scheduler wins (DeepSpeed 0.15+), a
    # migration trial; with its own params (cycle_min_lr, ...) it was once "misspelt keys".
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3} if name == "OneCycle" else {"total_num_steps": 10}
    r = convert_deepspeed_config({"scheduler": {"type": name, "params": params}, "zero_optimization": {"stage": 2}})
    assert r.scheduler is None and f"scheduler.type={name!r} (a DeepSpeed scheduler) is not built here" in \
        r.unsupported_scheduler
    own = _own_optimizer_module(with_scheduler=True)
    own.trainer = SimpleNamespace(estimated_stepping_batches=7)  # type: ignore[assignment]
    r.install_optimizers(own)
    with pytest.warns(DeepSpeedConfigWarning, match="scheduler section is\\s+ignored"):
        out = own.configure_optimizers()
    assert _single_scheduler(out) is not None  # the module's, untouched
    plain = _own_optimizer_module()
    plain.trainer = SimpleNamespace(estimated_stepping_batches=7)  # type: ignore[assignment]
    r.install_optimizers(plain)
    with pytest.raises(DeepSpeedConfigError, match=f"configures no LR scheduler, and the config's scheduler.type={name!r}"):
        plain.configure_optimizers()
    with pytest.raises(DeepSpeedConfigError, match="configures no optimizer"):
        r.configure_optimizers(_bare_module())
    with pytest.raises(DeepSpeedConfigError, match="remove the scheduler section"):
        r.hydra_values(2)


def _single_scheduler(result):
    from lightning_ampzero._deepspeed.result import _single_optimizer

    return _single_optimizer(result)[1]


def test_no_stage_0_note_when_a_stage_is_given_beside_the_config():
    # "zero_optimization.stage: absent: stage 0 ..." was said for AmpZeroStrategy(config={...}, stage=3),
    # which runs stage 3 (a migration trial)
    from lightning_ampzero.strategy import AmpZeroStrategy

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert AmpZeroStrategy(config={"gradient_clipping": 1.0}, stage=3).config.zero.stage == 3
    assert not [w for w in said if "absent: stage 0" in str(w.message)]
    with pytest.warns(DeepSpeedConfigWarning, match="absent: stage 0"):
        assert AmpZeroStrategy(config={"gradient_clipping": 1.0}).config.zero.stage == 0


def test_a_keyword_that_replaces_a_value_of_the_config_is_named(monkeypatch):
    # AmpZeroStrategy(config=<"stage": 1>, stage=3) trained at stage 3 and said nothing of the file's
    # stage 1 (a migration trial): each replaced value is now named, with the key it came from.
    import lightning_ampzero.strategy as strategy_module
    from lightning_ampzero.config import AmpZeroConfig, ZeroConfig
    from lightning_ampzero.strategy import AmpZeroStrategy

    said: list[str] = []
    monkeypatch.setattr(strategy_module, "rank_zero_info", said.append)
    ds = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7, "offload_optimizer": {"device": "cpu"}},
          "bf16": {"enabled": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        strategy = AmpZeroStrategy(config=ds, stage=3, reduce_bucket_size=5e7, offload_optimizer="none",
                                   precision="32-true")
    assert strategy.stage == 3 and strategy.config.offload.offload_optimizer == "none"
    assert said == ["AmpZeroStrategy: keywords given beside `config` replace its values:"
                    " stage 1 -> 3 (the DeepSpeed config's zero_optimization.stage),"
                    " offload_optimizer 'cpu' -> 'none' (the DeepSpeed config's zero_optimization.offload_optimizer.device),"
                    " precision 'bf16-mixed' -> '32-true' (the DeepSpeed config's bf16.enabled)."]
    # reduce_bucket_size was given equal to the file's: nothing replaced, nothing said of it. A stage
    # the file does not set (DeepSpeed's default 0) is not the file's to lose either.
    said.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        AmpZeroStrategy(config={"gradient_clipping": 1.0}, stage=3)
    assert said == []
    AmpZeroStrategy(config=AmpZeroConfig(zero=ZeroConfig(stage=1)), stage=2)
    assert said == ["AmpZeroStrategy: keywords given beside `config` replace its values: stage 1 -> 2."]
    said.clear()
    AmpZeroStrategy(stage=2)  # no config: nothing is replaced
    assert said == []


def test_a_deepspeed_activation_checkpointing_section_on_a_model_without_blocks_names_the_section():
    # the error said to name block classes; the section the user never meant as "checkpoint" was the cause
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ampzero.strategy import AmpZeroStrategy

    strategy = AmpZeroStrategy(config={"zero_optimization": {"stage": 2},
                                       "activation_checkpointing": {"partition_activations": False}})
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="found no block to checkpoint.*turned on by the activation_checkpointing"
                                             " section of the DeepSpeed config <dict>: remove that section"):
            trainer.fit(BoringModel())
