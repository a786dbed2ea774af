"""Pipeline parallelism: schedules as data, a simulator that checks and times them, and the runtime."""

from .actions import Action, Op, Schedule, stage_to_rank

__all__ = ["Action", "Op", "Schedule", "stage_to_rank"]
