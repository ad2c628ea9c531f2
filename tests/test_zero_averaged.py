"""Lightning's StochasticWeightAveraging at stages 1-3 ([Note: an averaged copy of a sharded model]
and [Note: the averaged copy in a sharded checkpoint] in lightning_ampzero/zero/averaged.py)."""

from __future__ import annotations

import pytest
from torch import nn

from _scripts import run_json


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("swa")
    return run_json("swa.py", root / "out.json", "--dir", str(root / "ckpt"), timeout=600)


@pytest.mark.parametrize("run", ["stage1", "stage2", "stage3", "stage2/saving", "stage3/saving", "resume/2->2",
                                 "resume/2->3", "resume/3->1"])
def test_swa_with_batchnorm_trains_and_resumes_as_under_ddp(averaged, run):
    # Before: stages 1-3 stopped at the first averaging epoch on torch's "aten.copy_.default got
    # mixed torch.Tensor and DTensor"; a resume loaded rank 0's shards of the copy on every rank;
    # without a checkpoint callback the model kept the copy gathered before SWA's last optimizer
    # step ([Note: a step without a backward] in zero/apply.py).
    ref, ours = averaged["ddp"], averaged[run]
    assert ours.keys() == ref.keys()
    for name, values in ref.items():
        assert ours[name] == values, name  # bit for bit: SWA's operations are element-wise
    # SWA changed the result (the average, BatchNorm's recomputed statistics): the test can fail.
    assert averaged["ddp/no_swa"]["head.weight"] != ref["head.weight"]
    assert averaged["ddp/no_swa"]["norm.running_mean"] != ref["norm.running_mean"]


def test_a_copy_without_the_layers_configure_model_builds_is_refused_with_what_to_do():
    from lightning_ampzero.zero.averaged import shard_like

    model = nn.Module()
    model.layer = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"before configure_model\(\) runs.*\(layer.bias, layer.weight\).*__init__"):
        shard_like(nn.Module(), model)
    copy = nn.Module()
    copy.layer = nn.Linear(2, 2)
    assert shard_like(copy, model) == 0  # nothing sharded: nothing to replace
    assert isinstance(copy.layer.weight, nn.Parameter) and not hasattr(copy.layer.weight, "device_mesh")


@pytest.mark.parametrize("run", ["stage1/then", "stage3/then"])
def test_swa_validate_and_a_second_fit_after_fit_run_as_under_ddp(averaged, run):
    # [Note: SWA's setup on a model already sharded] in zero/averaged.py: the callback's setup in
    # trainer.validate (and the next fit) after fit stopped with "FSDP does not support deepcopy".
    ref, ours = averaged["ddp/then"], averaged[run]
    assert ours == ref
    assert ref["head.weight"] != averaged["ddp"]["head.weight"]  # the second fit trained on


@pytest.mark.parametrize("stage", [1, 3])
def test_callbacks_that_read_whole_parameters_are_refused_at_setup_with_what_works(stage):
    # ModelPruning stopped at the end of the epoch on "would remove or reshape sharded dimension 0" (a
    # new-user trial)
    import re
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelPruning
    from lightning.pytorch.demos.boring_classes import BoringModel

    callback, instead = ModelPruning("l1_unstructured", amount=0.5), "prune at stage 0 (DDP)"
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=f"ampzero_stage_{stage}", max_steps=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"ModelPruning reads the model's parameters as whole"
                                             rf" tensors, and at ZeRO stage {stage}.*{re.escape(instead)}"):
            trainer.fit(BoringModel())


@pytest.fixture(scope="module")
def ema(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    return run_json("ema.py", root / "out.json", "--dir", str(root / "ckpt"), timeout=600)


@pytest.mark.parametrize("run", ["stage1", "stage3", "stage2/saving", "stage3/saving"])
def test_ema_trains_and_validates_with_the_average_as_under_ddp(ema, run):
    # [Note: EMAWeightAveraging at stages 1-3]: before, the callback stopped at the first validation on
    # torch's "got mixed torch.Tensor and DTensor" (then it was refused at stages 1-3).
    ref, ours = ema["ddp"], ema[run]
    assert ours.keys() == ref.keys()
    for name, values in ref.items():
        assert ours[name] == values, name  # bit for bit, the validation losses (of the averaged weights) too
    # the average changed the result: the test can fail
    assert ema["ddp/no_ema"]["val"] != ref["val"] and ema["ddp/no_ema"]["head.weight"] != ref["head.weight"]


@pytest.mark.parametrize("run", ["resume/2->2", "resume/2->3", "resume/3->1"])
def test_ema_resumes_from_a_sharded_checkpoint_at_any_stage_as_ddp_resumes(ema, run):
    # The model's own weights (current_model_state) were written from rank 0 only, beside the averaged ones.
    ref, ours = ema["resume/ddp->ddp"], ema[run]
    assert ours == ref and len(ref["val"]) == 2
    assert ref["val"] == ema["ddp"]["val"][2:]  # and ddp's resume continues the uninterrupted run
    assert {k: v for k, v in ref.items() if k != "val"} == {k: v for k, v in ema["ddp"].items() if k != "val"}
