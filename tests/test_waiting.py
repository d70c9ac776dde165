from __future__ import annotations

import itertools

import pytest

from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for

QUICK = Tier("quick_test", 0.3, "unit test")


def test_returns_first_value_that_satisfies_predicate():
    counter = itertools.count()
    assert wait_for(lambda: next(counter), lambda v: v >= 3, timeout=Tier("t", 5, ""), description="count",
                    interval=0.001) == 3


def test_timeout_names_what_was_awaited_and_last_value_and_error():
    calls = itertools.count()

    def observe():
        if next(calls) % 2:
            raise ConnectionError("refused")
        return "pending"

    with pytest.raises(WaitTimeout) as info:
        wait_for(observe, lambda v: v == "ready", timeout=QUICK, description="the thing to be ready", interval=0.01)
    message = str(info.value)
    assert "the thing to be ready" in message
    assert "quick_test=0.3s" in message
    assert "'pending'" in message
    assert "ConnectionError: refused" in message
    assert info.value.last_value == "pending"


def test_unexpected_exceptions_propagate():
    with pytest.raises(KeyError):
        wait_for(lambda: {}["x"], timeout=QUICK, description="x", ignore=(ConnectionError,))


def test_tier_override_from_environment(monkeypatch):
    tier = Tier("unit_override", 10, "")
    monkeypatch.setenv("RAYPROOF_TIMEOUT_UNIT_OVERRIDE", "2.5")
    assert tier.seconds == 2.5
    monkeypatch.setenv("RAYPROOF_TIMEOUT_UNIT_OVERRIDE", "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        _ = tier.seconds
