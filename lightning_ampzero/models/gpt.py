"""A small GPT (decoder-only transformer) and its LightningModule.

The model is deliberately plain PyTorch (nn.Linear, nn.LayerNorm, nn.Embedding) so that every
partitioning, precision and checkpointing feature is exercised on the module types users have.
Transformer blocks live in an ``nn.ModuleList`` so the automatic wrap policy finds them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ampzero.models.config import GPTConfig
from lightning_ampzero.models.init import init_parameters_
from lightning_ampzero.optim import adam_implementation


def gpt_adamw(model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.95),
              weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW for a GPT: weight decay on matrices except the position embedding, fused where possible."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "wpe" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **adam_implementation(groups))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init, identical for whole and sharded parameters (see models/init.py)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)

        def rule(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
            if name.endswith("bias"):
                return torch.zeros(shape)
            if ".ln_" in name or name.startswith("ln_"):
                return torch.ones(shape)
            std = residual_std if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
            return torch.randn(shape, generator=gen) * std

        init_parameters_(self, self.cfg.seed, rule)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.cfg.block_size}.")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _lightning_module_base() -> type:
    import lightning.pytorch as pl

    return pl.LightningModule


class GPTModule(_lightning_module_base()):  # type: ignore[misc]
    """LightningModule training :class:`GPT` on next-token prediction with AdamW.

    The model is built in ``configure_model`` so a ZeRO-3 strategy can build it on the meta
    device and shard it before any rank holds the whole model.
    """

    def __init__(
        self,
        model: Optional[GPTConfig] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        self.model_cfg = model if isinstance(model, GPTConfig) else GPTConfig.from_dict(model)
        self.lr, self.weight_decay, self.betas, self.warmup_steps = lr, weight_decay, tuple(betas), warmup_steps
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.model_cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = gpt_adamw(self, self.lr, self.betas, self.weight_decay)
        if not self.warmup_steps:
            return optimizer
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
