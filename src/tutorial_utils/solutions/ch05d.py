"""Solutions to the exercises of chapter 5d, "Time to accuracy".

Both are functions the chapter itself calls, in :mod:`tutorial_utils.bench.experiment`:
:func:`~tutorial_utils.bench.experiment.time_to_accuracy` (exercise 1) and
:func:`~tutorial_utils.bench.experiment.shortest_schedule` (exercise 2).
"""

from ..bench.experiment import shortest_schedule, time_to_accuracy

__all__ = ["shortest_schedule", "time_to_accuracy"]
