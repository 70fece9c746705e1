"""The Jupyter front-end: ``Panel``, an ipywidgets view over a workbench ``Session``.

``session.panel()`` returns one; display it as the last expression of a cell. Needs
ipywidgets and bqplot (``pip install 'workbench[notebook]'``); the core never imports this.
"""

from __future__ import annotations

from .charts import LiveChart, Trace
from .panel import MIN_INTERVAL, Panel

__all__ = ["Panel", "LiveChart", "Trace", "MIN_INTERVAL"]
