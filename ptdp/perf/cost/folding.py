"""Where a mixture-of-experts layer's experts live and what its tokens travel (parallel
folding, Liu et al. 2025, arXiv 2504.14960): the experts' own split of one pipeline stage's
t cp d ranks, apart from attention's (`ptdp.rules.layout.EXPERT_AXES`).

Over a stage's ranks, local index i = tp_coord + t (cp_coord + cp dp_coord): etp fastest
(i % etp), then ep ((i // etp) % ep), then edp = t cp d / (ep etp) (i // (etp ep)). So an ep
group is ep ranks etp apart, inside one node while ep etp fits in it; an edp group is
edp ranks etp ep apart. Tokens leave attention sequence-sharded (each tensor rank its s/t),
are all-gathered over etp (etp > 1), reach their experts by one all-to-all over ep and
come back by another, then are reduce-scattered over etp: a rank routes
`routed_tokens` = n etp / t tokens (n = its microbatch's s b / cp), each of its k choices
a row [h]. etp = t with ep over the dp cp ranks is the layout before folding (every tensor
rank routing its whole microbatch, the experts split like the dense MLP); `etp = None`
in this package's functions means that layout.

Letters: n = tokens of a microbatch on one cp rank (s b / cp), t = tensor-parallel size,
k = experts per token, h = hidden, e = routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """The experts' split of one stage's t cp d ranks."""

    tp: int
    ep: int
    etp: int
    ranks: int
    """t cp d: the ranks of one pipeline stage."""

    @classmethod
    def of(cls, tp: int, dp_cp: int, ep: int = 1, etp: int | None = None) -> Experts:
        """From the layout's sizes; `etp` None = t (the experts split like the dense layers)."""
        return cls(tp, ep, tp if etp is None else etp, tp * dp_cp)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: their gradients are reduced, and ZeRO shards their
        state, over these."""
        return self.ranks // (self.ep * self.etp)

    @property
    def ep_stride(self) -> int:
        """GPUs between two members of an ep group (etp: the ep coordinate follows etp's)."""
        return self.etp

    @property
    def edp_stride(self) -> int:
        return self.etp * self.ep

    def routed_tokens(self, tokens: int) -> float:
        """Tokens a rank routes of the `tokens` of its microbatch (n): its s/t sequence shard
        gathered over etp, n etp / t (module doc)."""
        return tokens * self.etp / self.tp
