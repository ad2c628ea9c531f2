"""[Note: parameters unused on some ranks] in zero/unused.py: stages 1-3 against Lightning's ddp."""

from __future__ import annotations

import pytest

from _scripts import run_json, run_script_failing
from _spawn import spawn


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_json("unused_on_some_ranks.py", tmp_path_factory.mktemp("unused") / "out.json", timeout=600)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_some_ranks_leave_unused_train_as_under_ddp(results, stage, accumulate):
    # Before: FSDP2 reduced, per rank, only the parameters with a local gradient: with the two
    # branches of one shape, rank 0's gradient of `a` was summed with rank 1's of `b` (0.0107 from
    # ddp after one SGD step; 0.05 after 4 AdamW steps).
    ref, ours = results[f"ddp/{accumulate}"], results[f"stage{stage}/{accumulate}"]
    assert ours.keys() == ref.keys()
    # Stages 2-3 reduce each micro-batch (DDP and stage 1 reduce the accumulated sum): fp32 rounding.
    exact = accumulate == 1 or stage == 1
    for name, values in ref.items():
        if exact or name.startswith("net.c."):  # `c`, which no rank runs, is untouched by weight decay
            assert ours[name] == values, name
        else:
            assert ours[name] == pytest.approx(values, abs=1e-6), name


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    return run_json("branch_units.py", tmp_path_factory.mktemp("branches") / "out.json", timeout=600)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_branch_that_is_a_unit_taken_on_some_ranks_stops_with_a_message(branches, stage):
    # [Note: units reduced in different orders]: before, the ranks' reduce-scatters paired unit `a`
    # on one rank with unit `b` on the other, silently (0.0023 from ddp after 3 SGD steps).
    error = branches[f"split/stage{stage}"].get("error", "")
    assert "reduced the gradients of some sharding units in different orders (units: a.linear; b.linear)" in error
    assert "reduce_bucket_size" in error and "stage 0" in error
    # The same model and units with every rank on one branch: no error, ddp's parameters bit for bit.
    assert branches[f"same/stage{stage}"] == branches["same/ddp"]


@pytest.fixture(scope="module")
def layerdrop(tmp_path_factory):
    return run_json("layerdrop.py", tmp_path_factory.mktemp("layerdrop") / "out.json", timeout=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hf_layerdrop_with_different_draws_per_rank_trains_as_transformers_synced_mode(layerdrop, stage):
    # [Note: layers dropped on some ranks]: every rank runs every layer, as transformers does
    # under FSDP, so no rank pairs one layer's collectives with another rank's of another layer.
    ref, ours = layerdrop["ddp/synced"], layerdrop[f"stage{stage}"]
    assert ours.keys() == ref.keys()
    for name, values in ref.items():
        assert ours[name] == values, name
    # The draws did differ between the ranks: dropping layers changes the result (else the test could not fail).
    assert any(layerdrop["ddp/dropping"][n] != v for n, v in ref.items())
    assert "drops layers at random per rank" in layerdrop["warning"]


def test_layers_dropped_names_the_hf_modules_that_drop_layers():
    from transformers import GPT2Config, GPT2LMHeadModel, Wav2Vec2Config, Wav2Vec2ForCTC

    from lightning_ampzero.zero.unused import layerdrop_message, layers_dropped

    gpt = GPT2LMHeadModel(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8))
    assert layers_dropped(gpt) == []
    config = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, conv_dim=(4,),
                  conv_stride=(5,), conv_kernel=(10,), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2)
    dropping = layers_dropped(Wav2Vec2ForCTC(Wav2Vec2Config(**config)))  # transformers' default layerdrop
    assert dropping == ["Wav2Vec2Encoder (layerdrop=0.1)"]
    assert "layerdrop=0.0" in layerdrop_message(dropping, 3)
    assert layers_dropped(Wav2Vec2ForCTC(Wav2Vec2Config(**config, layerdrop=0.0))) == []


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return run_json("generate_some_ranks.py", tmp_path_factory.mktemp("generate") / "out.json", timeout=600)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generate_on_rank_zero_only_and_of_different_lengths_runs_as_under_ddp(generated, stage):
    # [Note: generate() on some ranks]. Before: transformers' synced generation (on for every
    # model fully_shard marks) waited in an all-reduce for ranks that never came; the watchdog
    # ended the run at stages 2-3 where ddp printed the sample.
    ref, ours = generated["ddp"], generated[f"stage{stage}"]
    assert len(ref["samples"]) == 2 and ours["samples"] == ref["samples"]
    assert ours["params"].keys() == ref["params"].keys()
    for name, values in ref["params"].items():
        assert ours["params"][name] == pytest.approx(values, abs=1e-6), name


@pytest.mark.parametrize("stage", [1, 3])
def test_a_sharded_model_called_on_rank_zero_outside_the_steps_says_what_to_do(tmp_path, stage):
    # Stages 1-2: the root's parameters are sharded after a training step; torch's "got mixed
    # torch.Tensor and DTensor" from inside the model is now a message ([Note: a child called
    # outside a step method] in zero/apply.py). Stage 3 keeps the root gathered and its blocks
    # gather themselves, which works when every rank calls: rank 0 alone waits in their
    # all-gathers, and the watchdog says the ranks came from different places, in generate() (it
    # said "a collective that every rank entered is not completing (the network ...)").
    proc = run_script_failing("generate_some_ranks.py", "--out", str(tmp_path / "o.json"),
                              "--train-epoch-end-stage", str(stage))
    out = proc.stdout + proc.stderr
    if stage == 1:
        assert "GPT2LMHeadModel was called outside the LightningModule's step methods" in out
        assert "on_validation_epoch_end" in out and "no progress for the watchdog time" not in out
    else:
        # rank 0 in on_train_epoch_end's generate(), rank 1 in the next training_step's
        assert "but from different places" in out and "wait in generate(), not all from the same place" in out


def test_a_stage3_bf16_mixed_model_called_after_fit_runs_under_the_precisions_autocast(tmp_path):
    # [Note: a stage-3 model called after fit] in zero/apply.py. Before: the Linears, gathered in
    # bf16, met fp32 activations and the call stopped in attention (a new-user trial).
    out = run_json("after_fit_forward.py", tmp_path / "out.json", timeout=600)
    ref, ours = out["ddp"], out["stage3"]
    assert ours["dtype"] == ref["dtype"] == "torch.bfloat16"  # ddp's call under torch.autocast by hand
    # The two trainings differ only by stage 3's bf16 gradient reduction: a bf16 rounding or two.
    scale = max(abs(v) for v in ref["logits"])
    assert max(abs(a - b) for a, b in zip(ours["logits"], ref["logits"])) <= 1e-2 * scale


def test_an_encoder_decoders_generate_after_fit_at_stage_2_says_what_to_do(tmp_path):
    # [Note: a child called outside a step method] in zero/apply.py: T5's generate() runs its encoder,
    # a part of the wrapped model, and stopped on torch's "got mixed torch.Tensor and DTensor".
    out = run_json("encoder_after_fit.py", tmp_path / "out.json", timeout=300)
    assert out["stage2"] == out["ddp"] and len(out["ddp"]) == 2  # the hooks change nothing in the steps
    for rank in out["raised"]:
        for call in ("generate", "encoder"):
            assert rank[call].startswith("RuntimeError: T5Stack was called outside the LightningModule's step methods"), rank
            assert "mixed torch.Tensor and DTensor" not in rank[call]


def test_the_parts_checked_when_called_directly_leave_out_blocks_and_compiled_modules():
    # A hook on a compiled block is a graph break in it (seen with compile=True at stage 2): the
    # blocks of a ModuleList (their parent's loop calls them) and compiled modules are left out.
    from torch import nn

    from lightning_ampzero.zero.apply import _entry_points

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    class Wrapped(nn.Module):  # a Hugging Face model: an encoder and a decoder under .model
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.encoder, self.model.decoder = Stack(), Stack()
            self.head = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])

    root = nn.Module()
    root.net = Wrapped()
    root.net.head.compile()
    found = {name for name, m in root.named_modules() if any(m is e for e in _entry_points(root))}
    assert found == {"net.model", "net.model.encoder", "net.model.decoder"}, found


def _generate_alone_after_fit_body(rank, world_size):
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ampzero.zero.unused import generate_in_step

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=32))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # stage 3, as after fit: every unit sharded
    generate_in_step(model)
    if rank == 1:
        return None  # the script ends on this rank (its process exits: the sockets close)
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    except RuntimeError as error:
        return str(error)
    return "generated"


def test_generate_on_rank_zero_alone_after_fit_at_stage_3_says_so_not_a_crash():
    # if trainer.is_global_zero: model.generate(...) after fit: gloo's "Connection closed by peer ... typically
    # caused by a remote worker crashing" sent the user looking for a crash (a new-user trial)
    said, _ = spawn(_generate_alone_after_fit_body, world_size=2, timeout=120)
    assert said.startswith("GPT2LMHeadModel.generate() on rank 0: the model is sharded (ZeRO stage 3)"), said
    assert "the other ranks left (nothing crashed" in said and "Call generate() on every rank" in said
