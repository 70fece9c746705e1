"""The bottom layer: what every other layer of workbench shares, and nothing else.

The run's state objects (``state.py``), the callback protocol and its event names
(``callbacks.py``), TrainingArguments (``args/``), checkpoint folder and file names
(``names.py``), random-stream capture (``rng.py``), plain records and exit codes, the
typed ``Run`` and its loop position (``run.py``), the steering gates the loop calls
(``gates.py``), the stop request, the live-edit rule (``edits.py``) and the process world
(``world.py``). Nothing here imports another workbench package.
"""
