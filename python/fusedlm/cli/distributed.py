"""Several processes under ``torchrun``: DistributedDataParallel over a process group
(NCCL on CUDA, gloo on the CPU). Outside torchrun it is one process and every call
here is the identity."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Processes:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Processes":
        """Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one process without them)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        """Only this process writes files and prints progress."""
        return self.rank == 0

    def start(self, device: torch.device) -> None:
        if self.world > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def stop(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the processes."""
        if self.world > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world
        return value

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every process's ``obj``, in rank order (on every process)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out
