"""The staleness schedule of ``rollout.mode=async`` (the trainer's source and the
controller read the same object), by hand."""

from __future__ import annotations

from nemo_rlhf.rollout.staleness import StalenessSchedule


def test_the_staleness_schedule_by_hand():
    s = StalenessSchedule(2)
    assert [s.version_for(step) for step in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert s.buffer_size == 3
    assert s.last_step_ahead(3, max_steps=10) == 5 and s.last_step_ahead(9, max_steps=10) == 10
    s.begin_at(4)  # resumed after step 4: nothing older than version 4
    assert [s.version_for(step) for step in range(5, 10)] == [4, 4, 4, 5, 6]
    assert s.staleness(8, 5) == 2 and s.within_bound(8, 5)
    assert not s.within_bound(8, 4) and not s.within_bound(8, 8)  # 3 versions old; a version from the future
    assert [StalenessSchedule(0).version_for(step) for step in (1, 2, 3)] == [0, 1, 2]  # on-policy
