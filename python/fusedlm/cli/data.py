"""The training data order: token blocks visited in a fresh permutation each epoch.

The permutation of epoch e comes from a generator seeded with (seed, e), so the blocks
of any step are known from the step number alone: resuming needs no data-loader state
beyond the count of blocks already drawn, and every process draws the same global
batch and takes its own rows of it.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor


class BlockOrder:
    def __init__(self, blocks: Tensor, seed: int):
        if blocks.shape[0] == 0:
            raise ValueError("no blocks to train on")
        self.blocks, self.seed = blocks, seed
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def take(self, start: int, count: int) -> Tensor:
        """Blocks number start .. start + count - 1 of the endless epoch-after-epoch order."""
        index = []
        for i in range(start, start + count):
            epoch, position = divmod(i, len(self))
            index.append(int(self._permutation(epoch)[position]))
        return self.blocks[index]

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self), generator=generator)
        return self._perm


def fingerprint(blocks: Tensor) -> str:
    """A short digest of the blocks: a resumed run checks it trains on the same data."""
    return hashlib.sha256(blocks.contiguous().numpy().tobytes()).hexdigest()[:16]
