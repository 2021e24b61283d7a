"""What a parameter is for, beyond how it is sharded: a typed record owned by the model.

Two roles change how a parameter's gradient is reduced, counted and saved:

- A *tied copy* holds the same weights as another parameter, its *original*: the last
  pipeline stage's output layer when the embedding of stage 0 is tied to it. It starts as
  the original's value, its gradient is summed with the original's over the embedding
  group, and it is neither counted in the gradient norm nor saved (it loads from the
  original).
- A *sequence-parallel* parameter is replicated over the tensor group but each rank
  applies it to its own sequence slice (norms, row-parallel biases, learned positions,
  under sequence parallelism): its gradient is a partial sum, summed over the tensor group.
  A mixture-of-experts router's weight and its experts' output bias are partial sums over
  the tensor group in the same way, with or without sequence parallelism (`ptdp.model.moe`),
  and carry the same role.

The record names parameters as `named_parameters()` of the module that owns it does: a
GPT chunk's names are global (layers keyed by their global index), so the records of a
rank's chunks merge into one (`rank_roles`). How a parameter is split over the tensor
group stays on the parameter itself (`ptdp.parallel.init.ShardSpec`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ParamRoles:
    """Parameter names by role; a name in no field is an ordinary parameter."""

    tied: dict[str, str] = field(default_factory=dict)
    """Tied copy's name -> its original's name (read-only)."""
    sequence_parallel: frozenset[str] = frozenset()
    """Names of the parameters whose gradient is summed over the tensor group."""

    def is_tied_copy(self, name: str) -> bool:
        return name in self.tied

    def original(self, name: str) -> str:
        """The name whose value parameter `name` holds: its original's if it is a tied copy."""
        return self.tied.get(name, name)

    def is_sequence_parallel(self, name: str) -> bool:
        return name in self.sequence_parallel

    def prefixed(self, prefix: str) -> ParamRoles:
        """The record of a parent module that holds this one's as submodule `prefix`."""
        return ParamRoles(
            tied={f"{prefix}.{k}": f"{prefix}.{v}" for k, v in self.tied.items()},
            sequence_parallel=frozenset(f"{prefix}.{n}" for n in self.sequence_parallel),
        )

    @staticmethod
    def merge(records: Iterable[ParamRoles]) -> ParamRoles:
        """One record for modules sharing a namespace (a rank's chunks)."""
        tied: dict[str, str] = {}
        sequence_parallel: set[str] = set()
        for record in records:
            tied.update(record.tied)
            sequence_parallel.update(record.sequence_parallel)
        return ParamRoles(tied=tied, sequence_parallel=frozenset(sequence_parallel))


NO_ROLES = ParamRoles()
"""The record of a plain module: no tied copies, no sequence-parallel parameters."""


class HasParamRoles(Protocol):
    """A model chunk that owns its record (`ptdp.model.gpt.GPT`)."""

    roles: ParamRoles


def rank_roles(chunks: Iterable[HasParamRoles]) -> ParamRoles:
    """The merged record of a rank's model chunks."""
    return ParamRoles.merge(chunk.roles for chunk in chunks)
