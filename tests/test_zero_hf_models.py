"""Hugging Face models whose layout broke the units: tied embeddings, shared embeddings, parameters
held by non-leaf modules. Tiny configs, 2 CPU ranks, ``apply_zero`` at stage 2 and 3 with a bucket
smaller than the model (so the model is split into units), against one process on both ranks'
batches: per-step losses within 1e-5 relative and the same parameters after training.

* GPT-2 and OPT: ``lm_head.weight`` is the token embedding (leftover modules in different runs);
* T5: ``shared``, the encoder's and the decoder's ``embed_tokens`` and ``lm_head`` hold one weight;
* ViT: ``ViTEmbeddings`` holds ``cls_token`` and ``position_embeddings`` beside its patch Conv2d.

Before the fix: "is shared with a parameter already managed by another FSDP group" at the first
step (GPT-2, OPT, T5) and "Cannot concatenate overlapping meshes" in setup (ViT). The last test
runs GPT-2 and ViT through the Trainer (tests/scripts/units_tied.py) against stage 0.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import spawn

transformers = pytest.importorskip("transformers")

STEPS = 3
BUCKET = 3_000  # elements: smaller than each model below, at least a block
MODELS = ("gpt2", "opt", "t5", "vit")


def _model(kind):
    t = transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                           eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return t.GPT2LMHeadModel(cfg)
    if kind == "opt":
        cfg = t.OPTConfig(num_hidden_layers=2, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=64,
                          max_position_embeddings=16, word_embed_proj_dim=16, bos_token_id=0, eos_token_id=0,
                          pad_token_id=1, dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
        return t.OPTForCausalLM(cfg)
    if kind == "t5":
        cfg = t.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return t.T5ForConditionalGeneration(cfg)
    cfg = t.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
                      patch_size=4, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return t.ViTForImageClassification(cfg)


def _batch(kind, step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    if kind == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=gen), "labels": torch.randint(0, 3, (2,), generator=gen)}
    ids = torch.randint(2, 64, (2, 8), generator=gen)
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(2, 64, (2, 5), generator=gen)}
    return {"input_ids": ids, "labels": ids}


def _cat(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def _train(model, batches):
    # SGD: GPT-2's attention key bias has a gradient that is zero up to rounding, which Adam turns
    # into a full-size step of either sign (one process and two differ there by 2 lr, not by rounding).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def _full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _body(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ampzero.config import ZeroConfig
    from lightning_ampzero.zero.apply import apply_zero

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for kind in MODELS:
        if rank == 0:
            model = _model(kind)
            batches = [_cat([_batch(kind, s, r) for r in range(world_size)]) for s in range(STEPS)]
            out[kind, "ref"] = ([loss.item() for loss in _train(model, batches)], _full(model))
        for stage in (2, 3):
            model = _model(kind)
            units = apply_zero(model, mesh, ZeroConfig(stage=stage, reduce_bucket_size=BUCKET,
                                                       param_persistence_threshold=0))
            losses = []
            for loss in _train(model, [_batch(kind, s, rank) for s in range(STEPS)]):
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world_size)
            out[kind, stage] = (losses, _full(model), len(units))
    return out


@pytest.mark.slow  # about a minute: four models, two stages, two ranks
def test_hf_models_with_shared_and_non_leaf_parameters_match_one_process():
    results = spawn(_body, world_size=2, timeout=400)
    for kind in MODELS:
        ref_losses, ref_params = results[0][kind, "ref"]
        initial = dict(_model(kind).named_parameters())
        assert all(not torch.equal(p, initial[n]) for n, p in ref_params.items() if "bias" not in n), kind  # trained
        for stage in (2, 3):
            for r in results:
                losses, params, n_units = r[kind, stage]
                assert n_units > 3, (kind, n_units)  # split into units: the case that failed
                rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                assert rel < 1e-5, (kind, stage, losses, ref_losses)
                assert params.keys() == ref_params.keys()
                for name, p in params.items():
                    torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=f"{kind} {stage} {name}")


@pytest.mark.slow  # a Lightning script, 2 ranks, twelve fits: about 40 s
def test_through_lightning_every_stage_matches_stage_0(tmp_path):
    """GPT-2 (tied) and ViT (non-leaf parameters) as LightningModules, built in ``__init__``, split
    into units at stages 1-3 (a bucket smaller than the model: one block per unit), in fp32 and
    bf16-mixed (the Linear groups of "-mixed"): per-step losses equal to stage 0 (DDP) within 1e-5."""
    from _scripts import max_rel_diff, run_json

    configs = [f"{m}:{s}:13000:32-true" for m in ("gpt2", "vit") for s in (1, 2, 3)]
    configs += [f"{m}:3:13000:bf16-mixed" for m in ("gpt2", "vit")]
    references = [f"{m}:0:0:{p}" for m in ("gpt2", "vit") for p in ("32-true", "bf16-mixed")]
    results = run_json("units_tied.py", tmp_path / "tied.json", "--configs", ",".join(references + configs),
                       env={"OMP_NUM_THREADS": "1"}, timeout=400)
    for cfg in configs:
        model, _, _, precision = cfg.split(":")
        ref = results[f"{model}:0:0:{precision}"]
        assert len(results[cfg]) == len(ref) == 4
        assert max_rel_diff(results[cfg], ref) < 1e-5, (cfg, results[cfg], ref)
