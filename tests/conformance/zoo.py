"""The models of the conformance suite: architectures nobody on this project wrote.

Each entry builds a model exactly as a user would (a Hugging Face model from a tiny config, a
torch or Lightning module from its constructor), makes deterministic global batches, and
computes the loss the user would train on. Dropout is off everywhere: a dropout mask is drawn
per rank, so no sharded run could match one process with it on.

The zoo is imported by the training script (tests/conformance/train.py) and by the tests; it
imports transformers and peft lazily, inside the builders (they are test extras).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
SEQ = 16


@dataclass(frozen=True)
class Entry:
    """One architecture: ``build()`` -> module, ``batch(gen, n)`` -> dict of tensors (dim 0 = samples),
    ``loss(model, batch)`` -> scalar mean over the batch's samples (so the mean over equal
    chunks equals what data parallelism computes); classifiers give ``predict(model, batch)`` ->
    (logits, targets) instead (cross-entropy, and an accuracy metric over ``classes``)."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None
    classes: int = 0
    predict: Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None = None


# ---- batches ------------------------------------------------------------------------------

def _tokens(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    return {"input_ids": ids}


def _masked_tokens(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    labels = torch.full_like(ids, -100)
    # The same number of masked positions in every row: each rank's mean is over the same count.
    pos = torch.stack([torch.randperm(SEQ, generator=gen)[:4] for _ in range(n)])
    labels.scatter_(1, pos, ids.gather(1, pos))
    ids = ids.scatter(1, pos, 0)
    return {"input_ids": ids, "labels": labels}


def _seq2seq(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=gen),
            "labels": torch.randint(1, VOCAB, (n, SEQ // 2), generator=gen)}


def _images(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 5, (n,), generator=gen)}


def _features(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    x = torch.randn(n, 12, generator=gen)
    return {"x": x, "y": (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()}


def _seqs(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"src": torch.randn(n, 8, 32, generator=gen), "tgt": torch.randn(n, 6, 32, generator=gen),
            "out": torch.randn(n, 6, 32, generator=gen)}


# ---- losses -------------------------------------------------------------------------------

def _causal_lm_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=b["input_ids"], labels=b["input_ids"]).loss


def _hf_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**b).loss


def _image_predict(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return model(pixel_values=b["pixel_values"]).logits, b["labels"]


def _demo_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = b["input_ids"]
    out = model(ids[:, :-1], ids[:, 1:])
    return F.nll_loss(out, ids[:, 1:].reshape(-1))


def _transformer_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(b["src"], b["tgt"]), b["out"])


def _mlp_predict(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return model(b["x"]), b["y"]


def step(entry: Entry, model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """The training step's loss, and (logits, targets) for the accuracy metric from the same forward."""
    if entry.predict is None:
        return entry.loss(model, b), None
    logits, y = entry.predict(model, b)
    return F.cross_entropy(logits, y), (logits.detach(), y)


# ---- builders -----------------------------------------------------------------------------

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


def _hf(config_cls: str, model_cls: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_cls)(**kw)
        return getattr(transformers, model_cls)(config)
    return build


def _lora_llama() -> nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, ninp=32, nhead=4, nhid=64, nlayers=2, dropout=0.0)


def _torch_transformer() -> nn.Module:
    return nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                          dropout=0.0, batch_first=True)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


ZOO: dict[str, Entry] = {
    # transformers: decoders (tied and untied heads, rotary buffers), encoders, seq2seq, vision
    "gpt2": Entry(_hf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0), _tokens, _causal_lm_loss),
    "llama": Entry(_hf("LlamaConfig", "LlamaForCausalLM", **_DECODER), _tokens, _causal_lm_loss),
    "mistral": Entry(_hf("MistralConfig", "MistralForCausalLM", **_DECODER), _tokens, _causal_lm_loss),
    "qwen2": Entry(_hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER), _tokens, _causal_lm_loss),
    "opt": Entry(_hf("OPTConfig", "OPTForCausalLM", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                     dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1),
                 _tokens, _causal_lm_loss),
    "gpt_neox": Entry(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                          hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0),
                      _tokens, _causal_lm_loss),
    "bert": Entry(_hf("BertConfig", "BertForMaskedLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0), _masked_tokens, _hf_loss),
    "t5": Entry(_hf("T5Config", "T5ForConditionalGeneration", d_model=32, d_ff=64, d_kv=8, num_layers=2,
                    num_decoder_layers=2, num_heads=4, vocab_size=VOCAB, dropout_rate=0.0,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1), _seq2seq, _hf_loss),
    "vit": Entry(_hf("ViTConfig", "ViTForImageClassification", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4, num_labels=5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                 _images, classes=5, predict=_image_predict),
    "resnet": Entry(_hf("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16],
                        depths=[1, 1], layer_type="basic", num_labels=5),
                    _images, classes=5, predict=_image_predict),
    "lora_llama": Entry(_lora_llama, _tokens, _causal_lm_loss),
    # torch and Lightning
    "torch_transformer": Entry(_torch_transformer, _seqs, _transformer_loss),
    "lightning_demo_transformer": Entry(_demo_transformer, _tokens, _demo_loss),
    # a LightningModule whose metric is the point: torchmetrics accuracy over an MLP classifier
    "metrics_mlp": Entry(_mlp, _features, classes=4, predict=_mlp_predict),
}

#: Always run (the default suite); the rest is marked slow.
FAST = ("gpt2", "llama", "torch_transformer", "metrics_mlp", "resnet", "lora_llama")
