"""Point-to-point transfers of boundary tensors between pipeline ranks.

Sends and receives are posted with `torch.distributed.batch_isend_irecv`; a receive is
waited on only when its tensor is needed and a send only at the end of the step, so the
order of the schedule (checked by verify.py's dry run, which treats sends as
non-blocking) is all that is needed to avoid deadlock. Activations and gradients travel on
separate tags: between two ranks of an interleaved pipeline both kinds can flow the same
way, and each kind keeps its own order.

Scatter/gather (the paper's section 4.1): when tensor-parallel ranks hold identical
copies of the boundary activation, each sends only its 1/t slice and the receiver
all-gathers the slices over its tensor group, so the inter-node volume falls by t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.parallel.comm import Group, gather_full, send_recv_async

TAG_ACTIVATION, TAG_GRADIENT = 0, 1


@dataclass
class P2P:
    """Sends and receives of one shape over the pipeline group, with optional scatter/gather.

    `ranks` maps a pipeline coordinate to the global rank of the peer (same tp and dp).
    """

    ranks: list[int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tp: Group
    scatter_gather: bool = False

    def _wire_shape(self) -> tuple[int, ...]:
        if self.scatter_gather:
            numel = 1
            for n in self.shape:
                numel *= n
            return (numel // self.tp.size,)
        return self.shape

    def post(self, sends: list[tuple[int, torch.Tensor, int]], recvs: list[tuple[int, int]]):
        """Post sends (peer pp coordinate, tensor, tag) and receives (peer, tag) together.

        Returns (send works, [(recv work, wire buffer)]) in the order given.
        """
        wires, buffers = [], []
        for peer, tensor, tag in sends:
            wire = tensor.detach()
            if self.scatter_gather:
                wire = wire.reshape(self.tp.size, -1)[self.tp.rank]
            wires.append((wire.contiguous(), self.ranks[peer], tag))
        for peer, tag in recvs:
            buf = torch.empty(self._wire_shape(), dtype=self.dtype, device=self.device)
            buffers.append((buf, self.ranks[peer], tag))
        works = send_recv_async(wires, buffers)
        return works[: len(sends)], [(w, b[0]) for w, b in zip(works[len(sends) :], buffers)]

    def warm_up(self, pp_rank: int) -> None:
        """One tiny exchange with both neighbours, so that communicators (NCCL creates them
        lazily, per pair) exist before the first timed step."""
        pp = len(self.ranks)
        if pp == 1:
            return
        out = torch.zeros(1, dtype=self.dtype, device=self.device)
        into = torch.empty(1, dtype=self.dtype, device=self.device)
        after, before = self.ranks[(pp_rank + 1) % pp], self.ranks[(pp_rank - 1) % pp]
        for work in send_recv_async([(out, after, 0)], [(into, before, 0)]):
            work.wait()

    def finish_recv(self, work, buf: torch.Tensor) -> torch.Tensor:
        """Wait for a receive and return the full boundary tensor."""
        work.wait()
        if self.scatter_gather:
            buf = gather_full(buf, self.tp, 0)
        return buf.view(self.shape)
