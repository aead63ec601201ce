"""``jaxrl.data.schedule``: the public path of the data-parallel micro-batch schedule
(``build_dp_schedule``, ``DPSchedule``, ``ScheduleError``; docs/data.md). The implementation
lives with the packing it feeds, in ``jaxrl.data.batching.schedule``; this module is the name
users and the spec import, so the schedule has one implementation under two paths."""

from jaxrl.data.batching.schedule import (
    DPSchedule,
    ScheduleError,
    StepSchedule,
    StepStats,
    build_dp_schedule,
)

__all__ = ["DPSchedule", "ScheduleError", "StepSchedule", "StepStats", "build_dp_schedule"]
