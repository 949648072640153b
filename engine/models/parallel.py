"""A model's place in a tensor-parallel group, known when its layers are built.

Megatron's split of a decoder layer over N ranks: projections that feed attention heads or MLP
columns (QKV, gate/up) keep their rank's share of each part's output rows, so attention and the
activation run on local heads and columns; the projections after them (o, down) keep their
rank's share of the inputs, so each rank's product is a partial sum that one all-reduce makes
whole. The LM head keeps its rank's vocabulary rows and a gather puts the logits side by side
on rank 0. A layer takes its share as its weights load (`Linear.load`); the group's transport
(gloo processes) is engine.distributed.tensor_parallel's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.models.config import ModelConfig


@dataclass(frozen=True)
class Parallel:
    """rank of world, and the collectives the layers call (None on one rank)."""

    rank: int = 0
    world: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # in place, summed
    gather_columns: Callable[..., torch.Tensor] | None = None  # (local [M, n], total) -> rank 0

    @classmethod
    def of(cls, group) -> Parallel:
        """A group's (engine.distributed.tensor_parallel.Group), or one rank for None."""
        if group is None:
            return cls()
        return cls(group.rank, group.world, group.all_reduce, group.gather_columns)

    def rows(self, parts: list[int]) -> torch.Tensor:
        """The output rows this rank keeps of a projection stacked from `parts`: its share of
        each (its heads of Q, of K and of V; its columns of gate and of up)."""
        chunks = torch.arange(sum(parts)).split(parts)
        return torch.cat([chunk.chunk(self.world)[self.rank] for chunk in chunks])

    def columns(self, in_features: int) -> tuple[int, int]:
        """The inputs [start, end) this rank keeps of a projection split by input."""
        return self.rank * in_features // self.world, (self.rank + 1) * in_features // self.world

    def vocab_rows(self, total: int) -> tuple[int, int]:
        """The LM head rows [start, end) this rank computes: shares of ceil(total / world), the
        last one shorter when world does not divide total."""
        return vocab_rows(total, self.rank, self.world)


ONE_RANK = Parallel()


def vocab_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    width = -(-total // world)
    return min(rank * width, total), min((rank + 1) * width, total)


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank's shard has: its heads and MLP columns (what its KV cache holds)."""
    for name, value in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP columns", cfg.intermediate_size),
    ):
        if value % world:
            raise ValueError(
                f"tensor_parallel_size={world} must divide the model's {name} ({value})"
            )
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )
