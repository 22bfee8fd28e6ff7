"""Controllers of the dynamic steering tiers; :mod:`dynsteer.controllers.sync` is the per-step sync actuator tier.

Example:
    >>> from dynsteer.controllers import ThresholdLatch, run_controller
    >>> run_controller(ThresholdLatch(on=1.0, off=0.5, scale=1.0), [0.0, 1.0, 0.7, 0.4])
    [0.0, 1.0, 1.0, 0.0]
"""

from dynsteer.controllers.sync import (PID, Budget, BudgetState, EMALatch, EMALatchState, LatchState,
                                       StepObservation, SyncController, ThresholdLatch, applied_scales,
                                       make_controller, run_controller)

__all__ = ["Budget", "BudgetState", "EMALatch", "EMALatchState", "LatchState", "PID", "StepObservation",
           "SyncController", "ThresholdLatch", "applied_scales", "make_controller", "run_controller"]
