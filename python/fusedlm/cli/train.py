"""The training loop shared by pretrain and finetune: AdamW with linear warm-up and
decay (or a recipe's optimizer and schedule), gradient accumulation and clipping, autocast (with loss scaling for fp16), and
the progress display and metrics log."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch import nn

from .distributed import Processes

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


def adamw(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm or scalars),
    fused where torch has a fused kernel for the device, else foreach."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=lr, foreach=True)


def linear_schedule(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly over ``warmup`` steps, then falls linearly
    towards 0 at step ``total`` (the last step still has a non-zero rate)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(total - step, 0) / max(total - warmup, 1)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """One optimizer step over several micro-batches. ``model`` may be wrapped in
    DistributedDataParallel or sharded by FSDP (``processes.fsdp``); gradients are
    reduced on the last micro-batch only."""

    def __init__(self, model: nn.Module, *, lr: float, warmup: int, steps: int, clip: float,
                 dtype: torch.dtype, device: torch.device, processes: Processes,
                 optimizer: Optional[torch.optim.Optimizer] = None, scheduler=None):
        """``optimizer`` and ``scheduler`` (a recipe's own) replace AdamW at ``lr`` with the
        linear schedule over ``warmup`` and ``steps``."""
        self.model, self.clip, self.dtype, self.device = model, clip, dtype, device
        self.processes = processes
        self.optimizer = optimizer if optimizer is not None else adamw(model, lr)
        self.scheduler = (scheduler if scheduler is not None
                          else linear_schedule(self.optimizer, warmup, steps))
        scaler = torch.amp.GradScaler
        if processes.fsdp:
            # Each process sees only its shard's gradients: whether any is inf is agreed
            # between them, or one process would skip a step the others take.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as scaler
        self.scaler = scaler(device.type, enabled=dtype == torch.float16)

    def step(self, micro_losses: List[Callable]) -> tuple:
        """Runs forward and backward of every micro-batch (``loss(model)`` each: the loss,
        or (the loss, a dict of metrics such as an accuracy)), then the optimizer: (the
        mean loss, the mean of each metric) over micro-batches and processes."""
        self.model.train()
        total = torch.zeros((), device=self.device)
        metrics = {}
        for i, micro_loss in enumerate(micro_losses):
            last = i == len(micro_losses) - 1
            if self.processes.fsdp:
                self.model.set_requires_gradient_sync(last)
            with self.model.no_sync() if not last and hasattr(self.model, "no_sync") \
                    else contextlib.nullcontext():
                with torch.autocast(self.device.type, dtype=self.dtype,
                                    enabled=self.dtype != torch.float32):
                    loss = micro_loss(self.model)
                    if isinstance(loss, tuple):
                        loss, measured = loss
                        for name, value in measured.items():
                            metrics[name] = metrics.get(name, 0.0) + value.detach().float()
                self.scaler.scale(loss / len(micro_losses)).backward()
            total += loss.detach().float()
        self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        n = len(micro_losses)
        return (float(self.processes.mean(total / n)),
                {name: float(self.processes.mean(value / n)) for name, value in metrics.items()})

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        """Under FSDP every process must call it (the optimizer's shards are gathered);
        rank 0's is the whole state."""
        return {"optimizer": self.processes.optimizer_state(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.processes.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])


def inputs_to(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}


def rows(inputs: dict, rank: int, world: int) -> dict:
    """This process's share (an equal slice of rows) of a global batch."""
    return {k: v.chunk(world)[rank] for k, v in inputs.items()}


class Progress:
    """A tqdm bar with the loss, tokens/s and ETA, or (without tqdm) a plain line on
    stderr every ``log_every`` steps. Silent on processes other than rank 0."""

    def __init__(self, total: int, start: int, log_every: int, enabled: bool = True):
        self.total, self.start, self.log_every, self.enabled = total, start, log_every, enabled
        self.began = time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_s: float,
               metrics: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        metrics = metrics or {}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", **{k: f"{v:.4f}" for k, v in metrics.items()},
                                 tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif step % self.log_every == 0 or step == self.total:
            done = step - self.start
            eta = (time.perf_counter() - self.began) / max(done, 1) * (self.total - step)
            shown = "".join(f"  {k} {v:.4f}" for k, v in metrics.items())
            print(f"step {step}/{self.total}  loss {loss:.4f}{shown}  {tokens_per_s:,.0f} tok/s  "
                  f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """``metrics.jsonl`` in the output folder: one JSON record per logged step."""

    def __init__(self, out, keep_until: int = 0):
        """keep_until: the step a resumed run starts after; the records of later steps
        (written after its checkpoint) are dropped, as it logs those steps again."""
        self.path = Path(out) / METRICS_NAME
        kept = [r for r in read_metrics(self.path) if r["step"] <= keep_until]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path) -> list:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(out) -> Optional[Path]:
    """loss.png from metrics.jsonl, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(Path(out) / METRICS_NAME)
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if all(r["loss"] > 0 for r in records) and max(r["loss"] for r in records) > 4 * min(
            r["loss"] for r in records):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out) / PLOT_NAME
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

