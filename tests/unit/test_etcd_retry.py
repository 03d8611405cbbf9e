"""The agent's one-off etcd calls through a cluster member's restart (``agents/etcd_retry``)."""

from __future__ import annotations

import pytest

from agents.etcd_retry import again
from elastic_rt.errors import StoreConnectionError, StoreElectingError, StoreStateError


class _Flaky:
    """Fails its first ``failures`` calls with ``error``, then answers."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


@pytest.mark.parametrize("error", [StoreConnectionError("Stream removed"),
                                   StoreElectingError("no leader")])
def test_a_call_that_a_restarting_member_fails_is_tried_again(error: Exception) -> None:
    slept: list[float] = []
    call = _Flaky(2, error)
    assert again(call, "to read", within=5, sleep=slept.append, poll=0.1) == "answer"
    assert call.calls == 3 and slept == [0.1, 0.1]


def test_etcd_down_for_longer_than_the_wait_still_raises() -> None:
    call = _Flaky(10**9, StoreConnectionError("connection refused"))
    with pytest.raises(StoreConnectionError):
        again(call, "to read", within=0.05, sleep=lambda _: None)
    assert call.calls > 1


def test_what_would_fail_again_is_not_tried_again() -> None:
    call = _Flaky(1, StoreStateError("the round in etcd is not JSON"))
    with pytest.raises(StoreStateError):
        again(call, "to read", within=5, sleep=lambda _: None)
    assert call.calls == 1
