"""How long the compute stream really waits for host tier copies, on a GPU.

The worker orders the forward pass after copies with device-side waits
(``CopyJob.make_current_stream_wait``): the host enqueues the wait and moves
on at once, so timing the host measures the submission, about zero, while
the forward pass may stall behind a save for milliseconds. What the operator
wants is the stall. It is measured on the device: a timing event recorded on
the compute stream just before the waits and one just after. Nothing else is
enqueued between them, so the time between the two is how long the compute
stream stood still there (zero if the copies were done before it got
there). Sampled, one group of waits in ``every``, and scaled up, so the
metric costs two events now and then; read back when the events have
completed, never by blocking.

On CPU the copies run inside the step: the host time around them is the
wait, and the worker measures that instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: One group of waits in this many is timed (its time counted this many times).
DEFAULT_SAMPLE_EVERY = 4


class StreamWaitTimer:
    """Makes the current (compute) stream wait for copy jobs, timing the
    stall on sampled calls; :meth:`collect` returns the seconds measured
    since the last call."""

    def __init__(
        self,
        device: torch.device | None,
        every: int = DEFAULT_SAMPLE_EVERY,
        *,
        timed: bool | None = None,
        make_event: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"StreamWaitTimer every must be >= 1, got {every}")
        self.every = every
        # Seams for tests on a machine without a GPU; CUDA's by default.
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current_stream = current_stream or (
            lambda: torch.cuda.current_stream(device)
        )
        #: By default on CUDA devices only (elsewhere jobs have no events).
        if timed is None:
            timed = device is not None and torch.device(device).type == "cuda"
        self.timed = timed
        self._calls = 0
        self._pending: deque[tuple[Any, Any]] = deque()

    def wait(self, jobs: Sequence[Any]) -> None:
        """Order the current stream after every job in ``jobs`` (device-side,
        the host is not blocked); time it if this call is sampled."""
        jobs = [j for j in jobs if j.asynchronous]  # else complete when returned
        if not jobs:
            return
        self._calls += 1
        sampled = self.timed and self._calls % self.every == 0
        if sampled:
            stream = self._current_stream()
            before = self._make_event()
            before.record(stream)
        for job in jobs:
            job.make_current_stream_wait()  # the current stream: ``stream``
        if sampled:
            after = self._make_event()
            after.record(stream)
            self._pending.append((before, after))

    def collect(self) -> float:
        """Seconds of stall measured by the samples completed so far (each
        counted ``every`` times); samples still in flight wait for a later
        call. Never blocks."""
        total_ms = 0.0
        while self._pending and self._pending[0][1].query():
            before, after = self._pending.popleft()
            total_ms += before.elapsed_time(after)
        return total_ms * self.every / 1000.0
