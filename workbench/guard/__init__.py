"""The guard (against non-finite and spiking losses), one package, read in this order:

- ``settings.py``: ``Guard``, what the user asks for (the ``[guard]`` table).
- ``runner.py``: what the training loop holds: ``make_guard`` gives an active guard, or one
  whose every method does nothing when nothing is watched; its points in a step's order.
- ``checks.py``: each step judged, on the device (accelerators) or on the host (CPU).
- ``monitor.py``: the records: interventions, detector, progress, the event budget.
- ``flags.py``: a step's flags agreed across ranks before its optimizer step.
- ``ring.py`` and ``rollback.py``: in-memory rollback points, and going back to one.
- ``samples.py``: the dataset rows at a loop position, recomputed when a record names them.
"""

from workbench.guard.settings import GUARD_FIELDS, Guard

__all__ = ["Guard", "GUARD_FIELDS"]
