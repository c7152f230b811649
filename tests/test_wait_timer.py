"""The device-side copy wait metric, with stand-ins for CUDA streams and
timing events (this machine has no GPU).

The stand-ins model what the real ones do: a stream reaches each enqueued
operation at some device time, a wait holds it until the awaited copy is
done, an event records the time the stream reached it, ``query()`` says
whether it has, and ``elapsed_time`` gives milliseconds between two.
"""

from __future__ import annotations

import pytest

from vllm_kvmem.host_tier.wait_timer import StreamWaitTimer


class Stream:
    def __init__(self) -> None:
        self.t = 0.0  # ms: device time at which the stream reaches its tail
        self.done_up_to = 0.0  # ms: how far the device has run so far


class Event:
    """torch.cuda.Event(enable_timing=True), as the timer uses it."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.time: float | None = None

    def record(self, stream: Stream) -> None:
        assert stream is self.stream
        self.time = stream.t

    def query(self) -> bool:
        return self.time is not None and self.time <= self.stream.done_up_to

    def elapsed_time(self, end: Event) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event"
        return end.time - self.time


class Job:
    """A copy that completes at device time ``done_at`` (ms)."""

    def __init__(self, stream: Stream, done_at: float) -> None:
        self.stream, self.done_at = stream, done_at
        self.event = object()

    @property
    def asynchronous(self) -> bool:  # as CopyJob's: a job with an event
        return self.event is not None

    def make_current_stream_wait(self, stream=None) -> None:
        assert stream is None  # the current stream
        self.stream.t = max(self.stream.t, self.done_at)


def _timer(stream: Stream, every: int) -> StreamWaitTimer:
    return StreamWaitTimer(
        None,
        every,
        timed=True,
        make_event=lambda: Event(stream),
        current_stream=lambda: stream,
    )


def test_measures_the_stall_not_the_submission():
    stream = Stream()
    timer = _timer(stream, every=1)
    stream.t = 10.0  # the forward pass reaches the wait at 10 ms
    timer.wait([Job(stream, done_at=17.5), Job(stream, done_at=12.0)])
    assert timer.collect() == 0.0  # nothing has run yet: nothing read, no block
    stream.done_up_to = 100.0
    assert timer.collect() == pytest.approx(0.0075)  # stood still 7.5 ms
    assert timer.collect() == 0.0  # counted once
    # Copies done before the stream gets there: no stall.
    stream.t = 50.0
    timer.wait([Job(stream, done_at=20.0)])
    stream.done_up_to = 200.0
    assert timer.collect() == 0.0


def test_samples_one_group_in_every_and_scales_it():
    stream = Stream()
    timer = _timer(stream, every=4)
    for _ in range(8):  # every group stalls 2 ms
        timer.wait([Job(stream, done_at=stream.t + 2.0)])
        stream.t += 1.0  # a forward pass
    stream.done_up_to = 1e9
    assert timer.collect() == pytest.approx(8 * 2.0 / 1000)  # 2 samples x 4


def test_jobs_without_events_and_untimed_devices_wait_plainly():
    stream = Stream()
    made = []
    timer = StreamWaitTimer(
        None, 1, make_event=lambda: made.append(1), current_stream=lambda: stream
    )
    assert not timer.timed  # no CUDA device: nothing to time
    job = Job(stream, done_at=5.0)
    timer.wait([job])
    assert stream.t == 5.0 and made == []  # waited, no event
    done = Job(stream, done_at=9.0)
    done.event = None  # a CPU job: complete when returned
    timer.wait([done])
    assert stream.t == 5.0
    assert timer.collect() == 0.0
    with pytest.raises(ValueError, match="every must be >= 1"):
        StreamWaitTimer(None, 0)
