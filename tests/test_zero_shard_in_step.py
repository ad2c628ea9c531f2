"""A loss term computed in a step method from a parameter read outside its module's forward, where it is a shard.

[Note: a loss computed from a shard] in strategy.py and [Note: a gradient straight to a shard] in
zero/comm.py, on a Hugging Face Llama (tests/scripts/penalty_from_shard.py): an L2 penalty on one
block's ``up_proj.weight``, read in ``training_step`` before the forward, where stage 3 (and stage 2 with
the model in several units) holds its shard.
"""

from __future__ import annotations

import pytest
import torch

from _scripts import run_json, run_script_failing

pytest.importorskip("transformers")


def test_a_loss_made_a_dtensor_by_a_shard_stops_before_backward_with_a_way_out(tmp_path):
    # Before: torch's "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor", deep in backward.
    proc = run_script_failing("penalty_from_shard.py", "--mode", "raw", "--out", str(tmp_path / "o.json"))
    out = proc.stdout + proc.stderr
    assert "The loss is a DTensor" in out and "term.full_tensor()" in out
    assert "nll_loss_backward" not in out  # torch's own error, which the check before backward replaces


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_whole_value_of_a_penalty_on_a_shard_trains_as_under_ddp(tmp_path, precision):
    out = run_json("penalty_from_shard.py", tmp_path / "out.json", "--mode", "whole", "--precision", precision,
                   timeout=600)
    ref, ours, blocking = out["ddp"], out["stage3"], out["stage3_blocking"]
    assert ref["weight_is_dtensor"] == 0.0 and ours["weight_is_dtensor"] == 1.0  # the case it is about
    # The penalty's gradient reaches the shard while the unit's reduce-scatter is in flight: the
    # run equals the blocking one bit for bit. Before the hook it was lost (fp32: the penalty went
    # 0.0079 -> 0.0100 -> 0.0128 where ddp's went 0.0079 -> 0.0073 -> 0.0073).
    assert ours["params"] == blocking["params"]
    assert ours["penalties"] == blocking["penalties"]
    units = out["stage2_units"]
    assert units["weight_is_dtensor"] == 1.0  # sharded in the step below stage 3 too
    if precision == "32-true":  # and that is DDP's training, to fp32 rounding
        for run in (ours, units):
            assert run["penalties"] == pytest.approx(ref["penalties"], rel=1e-6)
            for name, values in ref["params"].items():
                assert run["params"][name] == pytest.approx(values, abs=1e-6), name
    else:  # bf16 rounding, amplified by AdamW's normalised step on near-zero gradients
        assert ours["penalties"] == pytest.approx(ref["penalties"], rel=1e-3)


def test_a_tensor_made_from_a_shard_in_training_step_is_explained():
    # Lightning's own LightningLSTM demo makes its hidden state with next(self.parameters()).new_zeros(...):
    # a DTensor at stage 3, and the LSTM stopped on torch's bare "aten.mkldnn_rnn_layer.default got mixed
    # torch.Tensor and DTensor" (a new-user trial). One process: FSDP2 shards over a mesh of one.
    import lightning.pytorch as pl
    from lightning.pytorch.demos.lstm import LightningLSTM
    from torch.utils.data import DataLoader

    class Demo(LightningLSTM):
        def prepare_data(self):  # WikiText2 would download
            pass

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = [(torch.randint(0, 50, (8,), generator=g), torch.randint(0, 50, (8,), generator=g))
                    for _ in range(4)]
            return DataLoader(data, batch_size=2)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ampzero_stage_3", max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match=r"new_zeros\(\.\.\.\)` \(Lightning's LightningLSTM demo\)") as info:
        trainer.fit(Demo(vocab_size=50))
    assert "got mixed torch.Tensor and DTensor" in str(info.value.__cause__)
    assert "torch.zeros(..., device=self.device)" in str(info.value)
