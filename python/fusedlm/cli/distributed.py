"""Several processes under ``torchrun``: DistributedDataParallel, or with ``fsdp`` FSDP2
(``fully_shard``: each process holds a shard of every parameter and of its optimizer
state), over a process group (NCCL on CUDA, gloo on the CPU). Outside torchrun it is
one process and every call here is the identity, except that FSDP still runs, on a
group of one."""
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
    fsdp: bool = False

    @classmethod
    def from_env(cls) -> "Processes":
        """Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one process without them)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def grouped(self) -> bool:
        """Whether the run needs a process group."""
        return self.world > 1 or self.fsdp

    @property
    def main(self) -> bool:
        """Only this process writes files and prints progress."""
        return self.rank == 0

    def start(self, device: torch.device) -> None:
        if not self.grouped or dist.is_initialized():
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if self.world == 1:  # FSDP without torchrun: a group of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)

    def stop(self, wait: bool = False) -> None:
        """Ends the process group; with ``wait``, once every process has got here. A run
        that finished waits: a process that tore its group down while another was still
        writing the last checkpoint could abort at exit (gloo). One that failed does not:
        the others may never arrive."""
        if not (self.grouped and dist.is_initialized()):
            return
        if wait and self.world > 1:
            dist.barrier()
        dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)

    def shard(self, model: torch.nn.Module, layers: list, device: torch.device,
              dtype: torch.dtype) -> torch.nn.Module:
        """FSDP2 in place: each of ``layers`` is a unit whose parameters are gathered only
        for its own forward and backward; the rest (embeddings, heads, tied weights) is
        the root's. Parameters move to ``device`` shard by shard, so the whole model is
        never on one GPU. On CUDA with a 16-bit ``dtype`` the gathered parameters are in
        it and gradients are reduced in fp32; on the CPU everything stays fp32."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (self.world,))
        policy = MixedPrecisionPolicy()
        if device.type == "cuda" and dtype != torch.float32:
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    def model_state(self, model: torch.nn.Module) -> dict:
        """The whole model's state dict, on the CPU on rank 0 (empty elsewhere): under FSDP
        every process must call it, as the shards are gathered."""
        if not self.fsdp:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_options())

    def optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        """The optimizer's whole state (under FSDP keyed by parameter name, gathered to
        rank 0's CPU; every process must call it)."""
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_options())

    def load_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """Loads what :meth:`optimizer_state` gave (each process keeps its shard)."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        set_optimizer_state_dict(model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))

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


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)
