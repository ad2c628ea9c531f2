"""What a Lightning user expects keeps working under every stage, on 2 ranks: sampler
injection, sync_dist logging, validation/test/predict, ModelCheckpoint + resume at the same
world size (same trajectory), manual optimization with two optimizers."""

from __future__ import annotations

import json

import pytest

from _scripts import run_json


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    return run_json("features.py", tmp / "out.json", "--stages", "0,1,2,3", "--tmp", str(tmp), timeout=1200)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_lightning_features(results, stage):
    r = results[stage]
    # DistributedSampler injected: each rank saw its own half of the 8 steps x 2 samples, no overlap
    assert r["sampler_disjoint"] and r["sampler_count"] == 16
    # self.log(..., sync_dist=True) averages over ranks: ranks 0 and 1 log 0.0 and 1.0
    assert r["rank_value"] == pytest.approx(0.5)
    assert r["val_loss_finite"]
    assert 0 < r["test_loss"] < 10
    # predict covers the dataset once across ranks
    assert r["predicted"] == list(range(8))
    assert r["params_equal_across_ranks"]
    # checkpoint is a sharded directory; resuming continues the uninterrupted trajectory
    assert r["checkpoint_is_dir"]
    assert r["first_losses"] == r["resume_full_losses"][:3]
    assert r["resume_losses"] == pytest.approx(r["resume_full_losses"][3:], rel=1e-6)
    # manual optimization, two optimizers, both stepped, ranks agree
    assert r["manual_steps"] >= 3 and r["manual_equal_across_ranks"] and r["manual_a_finite"]


def test_stages_agree_with_each_other(results):
    """Same seed and data: every stage reaches the same test loss."""
    losses = [results[s]["test_loss"] for s in "0123"]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])


def test_validate_before_fit_then_fit_trains_as_ddp(tmp_path):
    # [Note: units left gathered by evaluation] in strategy.py: at stage 3 the fit after a standalone
    # validate left the weights as they were (moved 0.0), with the losses still going down.
    out = run_json("eval_then_fit.py", tmp_path / "eval_then_fit.json", timeout=600)
    assert out["ddp"]["moved"] > 0.01
    for stage in (1, 2, 3):
        r = out[f"stage{stage}"]
        assert r["vs_ddp"] == 0.0 and r["moved"] == out["ddp"]["moved"] and r["val"] == out["ddp"]["val"], (stage, r)


def test_lr_find_and_a_resume_that_adds_a_scheduler_run_as_under_ddp(tmp_path):
    # [Note: param-group settings added since the save] in checkpoint/sharded.py: both stopped with
    # DCP's "Missing key ... optimizer_0.param_groups.0.initial_lr" at every stage.
    out = run_json("lr_find.py", tmp_path / "lr_find.json", "--tmp", str(tmp_path), timeout=600)
    for stage in (0, 3):
        r = out[f"stage{stage}"]
        assert r == {"suggestion": out["ddp"]["suggestion"], "after_lr_find": 0.0, "resumed": 0.0}, (stage, r)



def test_a_resume_saved_before_a_parameter_had_a_gradient_trains_as_ddp(tmp_path):
    # [Note: parameters without a saved optimizer state] in checkpoint/sharded.py: the resume stopped
    # at stages 0-3 with DCP's "Missing key ... optimizer_0.state.late.weight.step".
    out = run_json("late_param_resume.py", tmp_path / "late.json", "--tmp", str(tmp_path), timeout=600)
    assert out["ddp"]["late_moved"] > 1e-3 and not out["ddp"]["saved_with_state"] and out["ddp"]["end_with_state"]
    for stage in (0, 1, 3):
        assert out[f"stage{stage}"] == {**out["ddp"], "resumed_vs_ddp": 0.0, "whole_vs_ddp": 0.0}, (stage, out)

# ---------------------------------------------------------------------------------------
# LightningCLI ([Note: keywords a LightningCLI sees] in strategy.py)
# ---------------------------------------------------------------------------------------

def _cli_run(tmp_path, name: str, *args: str) -> dict:
    from _scripts import run_script

    out = tmp_path / f"{name}.json"
    run_script("lightning_cli.py", "fit", "--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.devices=2",
               "--trainer.max_steps=4", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
               "--trainer.enable_progress_bar=false", *args, env={"AMPZERO_TEST_OUT": str(out)}, timeout=300)
    return json.loads(out.read_text())


def test_lightning_cli_configures_the_strategy_from_yaml_as_deepspeeds_and_trains_as_ddp(tmp_path):
    # `init_args: {stage: 3}` stopped with jsonargparse's "Option 'stage' is not accepted": the
    # strategy's keywords were **overrides, which a LightningCLI cannot see.
    pytest.importorskip("jsonargparse")
    (tmp_path / "cfg.yaml").write_text(
        "trainer:\n  strategy:\n    class_path: lightning_ampzero.AmpZeroStrategy\n    init_args:\n"
        "      stage: 3\n      reduce_bucket_size: 1e6\n")
    ours = _cli_run(tmp_path, "ours", "--config", str(tmp_path / "cfg.yaml"))
    ddp = _cli_run(tmp_path, "ddp", "--trainer.strategy=ddp")
    assert (ours["strategy"], ours["stage"], ours["reduce_bucket_size"]) == ("AmpZeroStrategy", 3, 1e6)
    assert ours["world_size"] == ddp["world_size"] == 2 and ours["steps"] == ddp["steps"] == 4
    assert ours["weights"].keys() == ddp["weights"].keys()
    for name, w in ddp["weights"].items():
        assert ours["weights"][name] == pytest.approx(w, abs=1e-6), name


def test_lightning_cli_flags_reach_the_strategy_and_a_misspelt_one_is_refused():
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    base = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false",
            "--trainer.strategy=lightning_ampzero.AmpZeroStrategy"]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                       args=[*base, "--trainer.strategy.stage=2", "--trainer.strategy.offload_optimizer=cpu",
                             "--trainer.strategy.precision=bf16-mixed", "--trainer.strategy.compile=true"])
    config = cli.trainer.strategy.config
    assert (config.zero.stage, config.offload.offload_optimizer) == (2, "cpu")
    assert config.precision.precision == "bf16-mixed" and config.compile.enabled
    # unset keywords (None) left the defaults as they were
    assert config.zero.reduce_bucket_size == 5e8 and config.activation_checkpointing.mode == "none"
    with pytest.raises(SystemExit):  # jsonargparse reports the option it does not know
        LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                     args=[*base, "--trainer.strategy.stgae=2"])


def test_a_keyword_given_as_none_leaves_the_config_and_every_keyword_is_in_the_signature():
    import dataclasses
    import inspect

    from lightning_ampzero.config import AmpZeroConfig, OffloadConfig, ZeroConfig
    from lightning_ampzero.strategy import AmpZeroStrategy

    s = AmpZeroStrategy(config={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
                        stage=None, offload_optimizer=None, precision=None)
    assert (s.config.zero.stage, s.config.offload.offload_optimizer) == (3, "cpu")
    named = {p.name for p in inspect.signature(AmpZeroStrategy).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None}
    fields = {f.name for cls in (AmpZeroConfig, ZeroConfig, OffloadConfig) for f in dataclasses.fields(cls)} - {"zero"}
    lightning = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    assert named - lightning == fields


def test_a_keyword_of_a_nested_section_is_refused_with_where_it_lives():
    # A new-user trial passed AmpZeroStrategy(communication_data_type="fp32") (a README sentence
    # named the field without its section) and got only the list of flat keywords.
    from lightning_ampzero import LossScalerConfig, PrecisionConfig
    from lightning_ampzero.strategy import AmpZeroStrategy

    home = r"AmpZeroStrategy\(precision=PrecisionConfig\(communication_data_type=\.\.\.\)\)"
    with pytest.raises(TypeError, match=home):
        AmpZeroStrategy(communication_data_type="fp32")
    home = r"precision=PrecisionConfig\(loss_scaler=LossScalerConfig\(hysteresis=\.\.\.\)\)"
    with pytest.raises(TypeError, match=home):
        AmpZeroStrategy(hysteresis=2)
    with pytest.raises(TypeError, match="Did you mean 'stage'"):
        AmpZeroStrategy(stgae=2)
    # and the call the message names works
    s = AmpZeroStrategy(precision=PrecisionConfig(communication_data_type="fp32",
                                                  loss_scaler=LossScalerConfig(hysteresis=2)))
    assert (s.config.precision.communication_data_type, s.config.precision.loss_scaler.hysteresis) == ("fp32", 2)


def test_every_keyword_of_lightnings_deepspeed_strategy_is_taken_or_answered():
    """A port of DeepSpeedStrategy(...) keywords: each is taken as it is, or its message says what to write.

    A trial's port got a bare "unknown argument" for contiguous_gradients, logging_level, ...
    (the same keys in a JSON config are listed with a reason) and, for offload_optimizer=True,
    "Allowed values: 'none', 'cpu', 'nvme'" without saying True is 'cpu'.
    """
    import inspect

    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_ampzero.keywords import _flat_keywords
    from lightning_ampzero.strategy import AmpZeroStrategy

    # the Strategy's own constructor arguments, and the keywords taken as they are
    own = {"self", "accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "config"}
    own |= set(_flat_keywords()) - {"offload_optimizer"}  # (a bool offload_optimizer is answered)
    answered = 0
    for name, param in inspect.signature(DeepSpeedStrategy.__init__).parameters.items():
        if name in own:
            continue
        value = param.default if param.default not in (None, inspect.Parameter.empty) else 1
        try:
            AmpZeroStrategy(**{name: value})
        except (TypeError, ValueError) as error:
            message = str(error)
            assert f"Lightning's DeepSpeedStrategy({name}=" in message or "It is a field of" in message, message
            answered += 1
    assert answered >= 25  # most; the rest (stage, overlap_comm, reduce_bucket_size, ...) are taken as they are
    with pytest.raises(ValueError, match=r"DeepSpeedStrategy\(offload_optimizer=True\) is offload_optimizer='cpu'"):
        AmpZeroStrategy(stage=2, offload_optimizer=True)
    assert AmpZeroStrategy(stage=2, offload_optimizer=False).config.offload.offload_optimizer == "none"  # its default
    with pytest.raises(TypeError, match=r"is timeout_s=<seconds> here"):
        AmpZeroStrategy(timeout=60)
    assert AmpZeroStrategy(timeout_s=60).config.zero.timeout_s == 60  # what it names works
    # A port brings several at once: every one is answered in the one message (a trial got them one by one).
    with pytest.raises(TypeError) as several:
        AmpZeroStrategy(block_size=1, logging_batch_size_per_gpu=2, stagee=2)
    message = str(several.value)
    assert message.startswith("AmpZeroStrategy got 3 unknown arguments: 'block_size': Lightning's DeepSpeedStrategy(")
    assert "'logging_batch_size_per_gpu': Lightning's DeepSpeedStrategy(logging_batch_size_per_gpu=" in message
    assert "'stagee': Did you mean 'stage'?" in message


def test_sync_batchnorm_is_refused_on_cpu_at_every_stage(tmp_path):
    # Before, Trainer(sync_batchnorm=True) was ignored at every stage, silently: each rank normalized
    # with its own batch's statistics (a new-user trial: 3.6e-2 from one process on the whole batch).
    errors = run_json("sync_batchnorm.py", tmp_path / "out.json", timeout=600)
    for stage in "0123":
        assert "sync_batchnorm=True" in errors[stage] and "GPUs only" in errors[stage], stage


def test_sync_batchnorm_converts_the_batchnorm_layers_before_wrapping_on_a_gpu():
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
    from torch import nn

    from lightning_ampzero.strategy import sync_batchnorm_layers

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4)))
    weight = model[1].weight
    # conversion needs no GPU; only SyncBatchNorm's forward does
    out = sync_batchnorm_layers(TorchSyncBatchNorm(), model, "cuda")
    assert out is model and isinstance(model[1], nn.SyncBatchNorm) and isinstance(model[2][0], nn.SyncBatchNorm)
    assert model[1].weight is weight  # the same parameters: what the optimizer and the shards hold
    plain = nn.Sequential(nn.BatchNorm2d(4))
    assert sync_batchnorm_layers(None, plain, "cpu") is plain and type(plain[0]) is nn.BatchNorm2d
    # a SyncBatchNorm the model holds itself: on CPU with several processes torch stops in the first forward
    own = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match=r"holds torch's SyncBatchNorm \('1'\).*Use nn.BatchNorm1d/2d/3d on CPU"):
        sync_batchnorm_layers(None, own, "cpu", world_size=2)
    assert sync_batchnorm_layers(None, own, "cpu", world_size=1) is own  # one process: it does not synchronize
    assert sync_batchnorm_layers(None, own, "cuda", world_size=2) is own


def _weight_sum(module) -> float:
    return sum(getattr(p, "full_tensor", lambda p=p: p)().sum().item() for p in module.parameters())


@pytest.mark.parametrize("stage", [2, 3])
def test_test_after_fit_from_a_weights_only_best_checkpoint(tmp_path, stage):
    """trainer.test(ckpt_path="best") right after fit, with ModelCheckpoint(save_weights_only=True): the
    fit's optimizers are still there, and the load asked the checkpoint for their states (KeyError "contains
    only the model", a new-user trial). Outside a fit no optimizer state is loaded, as under ddp; the
    test then sees the best checkpoint's weights, not the last ones."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def validation_step(self, batch, batch_idx):
            loss = super().validation_step(batch, batch_idx)["x"]
            self.log("val_loss", float(self.current_epoch == 0) + 0 * loss)  # epoch 0 is the best
            return loss

        def test_step(self, batch, batch_idx):
            self.log("weight_sum", _weight_sum(self))
            return super().test_step(batch, batch_idx)

    best = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", mode="max", save_top_k=1,
                                        save_weights_only=True)
    weights_after: list[float] = []

    class AfterEpoch(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            weights_after.append(_weight_sum(pl_module))

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=f"ampzero_stage_{stage}", max_epochs=2,
                         limit_train_batches=3, limit_val_batches=1, limit_test_batches=1, logger=False,
                         callbacks=[best, AfterEpoch()], enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model())
        [result] = trainer.test(ckpt_path="best", verbose=False)
    assert best.best_model_path.endswith("epoch=0-step=3.ckpt")
    assert weights_after[0] != weights_after[1]
    assert result["weight_sum"] == pytest.approx(weights_after[0], rel=1e-6)
