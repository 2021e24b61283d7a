"""Interruptions and numerical faults: what the training loop does when a scheduler sends
SIGINT/SIGTERM, when a step's loss or gradient norm is not finite, and when the loss spikes.

Once per step, after the gradient norm, every rank all-reduces (MAX) one small tensor
[non-finite, signal] over all ranks: the ranks agree on skipping, stopping or rolling back a
step and on stopping for a signal at the same step, even when only one rank saw the NaN or
received the signal. It is one 2-element collective and one host sync per step. With the
fused AdamW kernel (CUDA) the trainer queues the update before that sync, passing the
agreed flag as the kernel's `found_inf`, which makes a bad step a no-op on the device: the
device keeps working while the host waits, instead of idling while it launches the update.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from ptdp.config.enums import OnNan
from ptdp.errors import PtdpError
from ptdp.parallel.comm import Group, all_reduce_max_value

SPIKE_WINDOW = 20
"""Steps whose median loss a new loss is compared with."""
SPIKE_FACTOR = 3.0
"""A loss above this multiple of that median is logged as a spike."""
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingError(PtdpError):
    """Training stopped on a fault (a non-finite loss or gradient norm)."""


class NumericalFault(Exception):
    """Raised inside a step whose loss or gradient norm is not finite (on every rank);
    the run loop stops or rolls back. `step` is the 1-based number of the bad step."""

    def __init__(self, step: int, loss: float, norm: float) -> None:
        super().__init__(f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}")
        self.step, self.loss, self.norm = step, loss, norm


class Interrupted(KeyboardInterrupt):
    """A second SIGINT stopped the run at once; the message says what was lost."""


class StopRequest:
    """While entered (in the main thread), SIGINT and SIGTERM only record the signal; the
    loop acts on it at the end of a step, and `notice` says so at once. A second SIGINT
    interrupts at once (KeyboardInterrupt; the loop says what was lost). The previous
    handlers are restored on exit. Elsewhere than the main thread it installs nothing."""

    def __init__(self, notice: Callable[[str], None] | None = None) -> None:
        self.signum = 0
        self.notice = notice
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = not self.signum
        self.signum = signum
        if first and self.notice is not None:
            again = (
                "; Ctrl-C again stops at once, losing the steps since the last checkpoint"
                if signum == signal.SIGINT
                else ""
            )
            try:  # inside a signal handler: never let the message break the run
                self.notice(
                    f"{signal.Signals(signum).name} received: the step in progress finishes, "
                    f"a checkpoint of it is saved, then the run stops{again}"
                )
            except (OSError, RuntimeError, ValueError):
                pass

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class FaultMonitor:
    """The per-step check: non-finite values (policy `on_nan`), signals, loss spikes."""

    def __init__(
        self, on_nan: OnNan, world: Group, device: torch.device, say: Callable[[str], None]
    ) -> None:
        self.on_nan, self.world, self.device, self.say = on_nan, world, device, say
        self.stop = StopRequest(say)
        self.signum = 0
        """The signal all ranks agreed to stop for (0: none)."""
        self.skipped = 0
        """Steps not applied for a non-finite loss or gradient norm (on_nan = skip)."""
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def flags(self, loss: torch.Tensor | None, norm: torch.Tensor, fp16: bool) -> torch.Tensor:
        """Collective, no host sync: [non-finite, signal], the MAX over all ranks, on the
        device. Under fp16 a non-finite norm is an overflow, the loss scaler's case."""
        bad = torch.zeros((), device=norm.device)
        if loss is not None and not fp16:
            bad = (~torch.isfinite(loss.float()) | ~torch.isfinite(norm.float())).float()
        signum = torch.full((), float(self.stop.signum), device=norm.device)  # no host copy
        return all_reduce_max_value(torch.stack([bad, signum]), self.world)

    def decide(
        self, step: int, loss: torch.Tensor | None, norm: torch.Tensor, flags: torch.Tensor
    ) -> bool:
        """The host sync of `flags`. True: skip this step (on_nan = skip). Raises
        NumericalFault for stop and rollback."""
        bad_any, signum = flags.tolist()
        self.signum = self.signum or int(signum)
        loss_value = loss.item() if loss is not None else float("nan")
        if not bad_any:
            self._watch_spike(step, loss_value)
            return False
        if self.on_nan is OnNan.SKIP:
            self.skipped += 1
            self.say(
                f"step {step}: non-finite loss ({loss_value}) or gradient norm "
                f"({norm.item()}); step skipped (train.on_nan = skip, {self.skipped} so far)"
            )
            return True
        raise NumericalFault(step, loss_value, norm.item())

    def _watch_spike(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if len(self.recent) == SPIKE_WINDOW:
            median = statistics.median(self.recent)
            if loss > SPIKE_FACTOR * median:
                self.say(
                    f"warning: loss spike at step {step}: {loss:.4f} > {SPIKE_FACTOR:g} x the "
                    f"median {median:.4f} of the last {SPIKE_WINDOW} steps"
                )
        self.recent.append(loss)


def lost_to_interrupt(done: int, last_good: Path | None, saving: bool) -> str:
    """What a second SIGINT lost: `done` steps were completed, `last_good` is the newest
    published checkpoint, `saving`: the first SIGINT's checkpoint was being written."""
    if saving:
        head = (
            f"a second SIGINT stopped the run at once while the checkpoint of step {done} that "
            "the first one asked for was being written (it is not published)"
        )
    else:
        head = (
            f"a second SIGINT stopped the run at once in step {done + 1}, before the checkpoint "
            "the first one asked for was written"
        )
    if last_good is None:
        return f"{head}; no checkpoint was saved, so all {done} completed steps are lost"
    saved = int(last_good.name.removeprefix("step_"))
    lost = (
        "no completed step is lost"
        if done <= saved
        else f"step {done} is lost"
        if done == saved + 1
        else f"steps {saved + 1}..{done} are lost"
    )
    return (
        f"{head}; the last checkpoint is {last_good} (step {saved}), {lost}; --resume "
        "continues from it"
    )
