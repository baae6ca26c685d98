"""scripts/async_rl.py's sample selection: staleness is the trainers' version minus the
oldest version that sampled a completion ("default": the starting weights, 0); samples
staler than max_lag are dropped and counted; the histogram counts every sample taken."""

from __future__ import annotations

import queue

from actors.tools.demo.async_rl import AsyncRlSettings, Tally, take_batch, version_number
from weight_transfer.engines.vllm.stream import Completion, Span, versions_seen


def completion(*versions: str) -> Completion:
    spans = tuple(Span(version=v, start=i * 4, end=i * 4 + 4) for i, v in enumerate(versions))
    return Completion(prompt=(1, 2), token_ids=tuple(range(4 * len(versions))), spans=spans,
                      finish_reason="length")


def test_stale_samples_are_dropped_and_counted():
    q: queue.Queue = queue.Queue()
    for c in [completion("default"), completion("1", "2"), completion("3"), completion("2"),
              completion("0", "3")]:
        q.put(c)
    tally = Tally()
    batch = take_batch(q, AsyncRlSettings(batch=3, max_lag=2), 3, tally)
    assert [c.versions for c in batch] == [("1", "2"), ("3",), ("2",)]
    assert (tally.produced, tally.used, tally.dropped_stale, tally.spanning) == (4, 3, 1, 1)
    assert dict(tally.staleness) == {3: 1, 2: 1, 0: 1, 1: 1}
    assert q.qsize() == 1


def test_a_starved_batch_times_out_naming_what_it_has():
    import pytest

    q: queue.Queue = queue.Queue()
    q.put(completion("default"))
    with pytest.raises(TimeoutError, match="1 of 2 samples"):
        take_batch(q, AsyncRlSettings(batch=2, max_lag=1, take_timeout_s=0.2), 0, Tally())


def test_versions_are_numbered_and_sorted():
    assert version_number("default") == 0 and version_number("12") == 12
    assert versions_seen([completion("10", "9"), completion("default")]) == ["9", "10",
                                                                            "default"]
