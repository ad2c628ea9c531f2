"""Frozen parameters (``requires_grad=False``): LoRA through peft on a tiny Hugging Face Llama.

2 CPU ranks (gloo), ``apply_zero`` at stage 1, 2 (the model one unit), 2 with a bucket of one
decoder layer and 3 with it: every decoder layer's FSDP2 group then mixes frozen base weights and
trainable LoRA weights. The optimizer is given every parameter (as ``model.parameters()`` usually
is). Measured per rank after a step (``lightning_ampzero.memory.measure_model_state``): no
frozen parameter has a gradient or optimizer state, the gradient bytes are those of the trainable
shards alone, the optimizer bytes two fp32 moments (and a step counter) per trainable shard; the
per-step losses and the trained LoRA weights match one process within 1e-5. At stage 1 the full
gradients a rank keeps through gradient accumulation are the trainable parameters' only.
"""

from __future__ import annotations

import pytest
import torch

from torch import nn

from _spawn import spawn

pytest.importorskip("peft")
pytest.importorskip("transformers")

V, T, STEPS = 64, 8, 3
ONE_LAYER = 20_000  # elements: a decoder layer below is 12,352 (LoRA included)
CONFIGS = ((1, 10**9), (2, 10**9), (2, ONE_LAYER), (3, ONE_LAYER))


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0, init_lora_weights="gaussian"))
    return model


def _batch(step, rank):
    return torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model, idx):
    logits = model(input_ids=idx[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), idx[:, 1:].reshape(-1))


def _reference(world_size):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, torch.cat([_batch(step, r) for r in range(world_size)]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _body(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.memory import measure_model_state
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    out = {"ref": _reference(world_size) if rank == 0 else None}
    for stage, bucket in CONFIGS:
        model = _model()
        units = apply_zero(model, mesh, ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            loss = _loss(model, _batch(step, rank))
            loss.backward()
            opt.step()
            if step == STEPS - 1:
                measured = measure_model_state(model, [opt])
                trainable = [p for p in model.parameters() if p.requires_grad]
                frozen = [p for p in model.parameters() if not p.requires_grad]
                record = dict(
                    measured=measured,
                    trainable_local=sum(_local(p).numel() for p in trainable),
                    n_trainable=len(trainable),
                    frozen_with_grad=sum(p.grad is not None for p in frozen),
                    frozen_with_state=sum(p in opt.state and bool(opt.state[p]) for p in frozen),
                    frozen_numel=sum(p.numel() for p in frozen),
                    units=len(units),
                )
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
        record["losses"] = losses
        record["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if stage == 1:
            # gradient accumulation: stage 1 keeps the full gradients between micro-batches, of the
            # trainable parameters only
            from lightning_ampzero.zero.apply import no_sync

            with no_sync(model, stage):
                _loss(model, _batch(STEPS, rank)).backward()
            record["accumulated"] = measure_model_state(model, [opt])["grads"]
            record["trainable_full"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            model.zero_grad(set_to_none=True)
        out[stage, bucket] = record
    return out


@pytest.mark.slow  # about 30 s: transformers + peft in two ranks, four configurations
def test_frozen_parameters_have_no_gradient_and_no_optimizer_state():
    results = spawn(_body, world_size=2, timeout=300)
    ref_losses, ref_params = results[0]["ref"]
    for stage, bucket in CONFIGS:
        for r in results:
            got = r[stage, bucket]
            assert got["frozen_numel"] > 10 * got["trainable_local"]  # mostly frozen: the case that matters
            assert got["frozen_with_grad"] == 0 and got["frozen_with_state"] == 0
            # the gradients held are the trainable shards' (fp32), nothing for the frozen ones
            assert got["measured"]["grads"] == 4 * got["trainable_local"], (stage, bucket, got["measured"])
            # AdamW: exp_avg + exp_avg_sq per trainable shard element, one fp32 step counter per parameter
            assert got["measured"]["optimizer"] == 8 * got["trainable_local"] + 4 * got["n_trainable"], \
                (stage, bucket, got["measured"])
            rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
            assert rel < 1e-5, (stage, bucket, got["losses"], ref_losses)
            assert got["params"].keys() == ref_params.keys()
            for name, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=f"{stage} {bucket} {name}")
    for r in results:
        assert r[1, 10**9]["accumulated"] == 4 * r[1, 10**9]["trainable_full"]
    assert results[0][3, ONE_LAYER]["units"] > 1
    assert ref_losses[-1] < ref_losses[0]


def test_parameters_unfrozen_and_frozen_during_training_are_averaged_at_stage_0(tmp_path):
    # [Note: parameters unfrozen during training] in strategy.py: with Lightning's BackboneFinetuning,
    # stage 0's ranks ended 0.02 apart (the unfrozen backbone never averaged); stage 1 is the reference.
    from _scripts import run_json

    out = run_json("unfreeze.py", tmp_path / "unfreeze.json", timeout=600)
    assert out == {"ranks_0": 0.0, "vs_stage_1_0": 0.0, "ranks_1": 0.0, "vs_stage_1_1": 0.0}, out


def test_requires_grad_changed_inside_training_step_trains_as_ddp_at_every_stage(tmp_path):
    # [Note: requires_grad changed inside a step] in zero/trainable.py: a GAN's toggle_optimizer()
    # trained the frozen discriminator at stages 1-2 (0.16 from ddp), and a layer frozen inside
    # training_step kept training at stages 1-2 (0.06) while stage 0's ranks drifted apart (0.04;
    # 0.04 again with accumulation, before AmpZeroStrategy._rewrap_ddp_before_backward kept no_sync).
    from _scripts import run_json

    out = run_json("freeze_in_step.py", tmp_path / "freeze_in_step.json", "--stages", "0,1,2,3", timeout=600)
    names = ("toggle", "freeze", "freeze_acc")
    assert set(out) == {f"{name}_{kind}_{stage}" for name in names for stage in range(4)
                        for kind in ("ranks", "vs_ddp")}
    for key, value in out.items():
        # stages 2-3 reduce each micro-batch of a window where ddp sums them first: rounding apart
        assert value <= (1e-6 if key in ("freeze_acc_vs_ddp_2", "freeze_acc_vs_ddp_3") else 0.0), (key, out)


def _lora_bf16_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ampzero.config import PrecisionConfig, ZeroConfig
    from lightning_ampzero.precision.policy import dtype_plan, fsdp_policies, safe_modules
    from lightning_ampzero.zero.apply import apply_zero

    def train(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, _batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        inner = getattr(model, "module", model)
        return losses, {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for n, p in inner.named_parameters() if p.requires_grad}

    plan = dtype_plan("bf16-mixed", PrecisionConfig())  # the default safe modules
    model = _model()
    chosen = [type(m).__module__ + "." + type(m).__name__ for _, m in safe_modules(model, plan.safe_modules)]
    root, per_module = fsdp_policies(plan, model, 3)
    apply_zero(model, init_device_mesh("cpu", (world_size,)),
               ZeroConfig(stage=3, reduce_bucket_size=ONE_LAYER, param_persistence_threshold=0), root,
               module_policies=per_module)
    return chosen, train(model), train(DistributedDataParallel(_model()))


def test_lora_at_stage3_bf16_mixed_trains_as_ddp_bit_for_bit():
    # [Note: another library's Linear] in precision/policy.py: peft's LoRA layer, a class named Linear,
    # was a safe module whose input stage 3 cast to bf16 once for its base and adapter paths; the
    # adapters ended 8.6e-3 from ddp's after 4 AdamW steps (a new-user trial). torch's Linears inside
    # it are the safe modules now, each casting its own input as autocast does: ddp's bits.
    for chosen, (losses, params), (ddp_losses, ddp_params) in spawn(_lora_bf16_body, world_size=2, timeout=240):
        assert chosen and set(chosen) == {"torch.nn.modules.linear.Linear"}, sorted(set(chosen))
        assert losses == ddp_losses
        assert params.keys() == ddp_params.keys() and any("lora_A" in n for n in params)
        for name, p in params.items():
            assert torch.equal(p, ddp_params[name]), name


def test_fitting_a_model_with_every_parameter_frozen_warns(tmp_path):
    # A trial's all-frozen model trained silently and changed nothing (Lightning's ddp refuses it).
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ampzero.strategy import AmpZeroStrategy

    class Frozen(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1).requires_grad_(False)
            self.bias = nn.Parameter(torch.zeros(()), requires_grad=False)

        def training_step(self, batch, i):
            return self.layer(batch[0]).sum() + self.bias

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AmpZeroStrategy(stage=2), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"No parameter of the model requires a gradient \(3 parameters, all frozen\)"):
        try:
            trainer.fit(Frozen(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
        except Exception:  # noqa: BLE001 - what the loss of no gradient does next is not this test's concern
            pass
