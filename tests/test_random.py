"""Seeding, RNG state and the tracker of named RNG states."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_core import ops, random


def _draw():
    return np.concatenate([ops.to_numpy(ops.rand((6,))), ops.to_numpy(ops.randn((6,))),
                           ops.to_numpy(ops.dropout(ops.ones((12,)), 0.5))])


def test_seed_reproduces_random_ops():
    random.seed(5)
    a = _draw()
    random.seed(5)
    b = _draw()
    random.seed(6)
    c = _draw()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_distributions():
    random.seed(0)
    u = ops.to_numpy(ops.rand((20000,)))
    n = ops.to_numpy(ops.randn((20000,)))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    kept = ops.to_numpy(ops.dropout(ops.ones((20000,)), 0.25))
    assert set(np.unique(kept)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((kept == 0).mean() - 0.25) < 0.02
    np.testing.assert_array_equal(ops.to_numpy(ops.dropout(ops.ones((5,)), 0.5, training=False)), 1)


def test_get_and_set_state_replays():
    random.seed(3)
    state = random.get_state()
    a = _draw()
    host_a = random.host_generator().standard_normal(3)
    random.set_state(state)
    np.testing.assert_array_equal(_draw(), a)
    np.testing.assert_array_equal(random.host_generator().standard_normal(3), host_a)


@pytest.mark.feature("rng-tracker")
def test_tracker_forks_named_states():
    tracker = random.tracker()
    tracker.reset()
    random.seed(1)
    tracker.add("model-parallel", 2718)
    with pytest.raises(ValueError):
        tracker.add("model-parallel", 99)
    with pytest.raises(ValueError):
        tracker.add("other", 2718)

    outer_state = random.get_state()
    with tracker.fork("model-parallel"):
        inside_1 = _draw()
    after_fork = _draw()
    random.set_state(outer_state)
    np.testing.assert_array_equal(_draw(), after_fork)  # forking left the default stream alone

    with tracker.fork("model-parallel"):
        inside_2 = _draw()
    assert not np.array_equal(inside_1, inside_2)  # the named stream advanced

    # A tracker seeded the same way on another rank reproduces the same named stream.
    saved = tracker.get_states()
    tracker.reset()
    tracker.add("model-parallel", 2718)
    with tracker.fork("model-parallel"):
        np.testing.assert_array_equal(_draw(), inside_1)
    tracker.set_states(saved)
    with pytest.raises(KeyError, match="not tracked"):
        with tracker.fork("nope"):
            pass
    tracker.reset()


def test_implementation_is_reported():
    assert random.implementation() in ("native", "emulated")
