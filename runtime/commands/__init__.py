"""What ``protrain-run`` may ask of the runtime besides the spec (``config/``): the what-if
planning command and its memory estimator (plans from files, without torch), the environment
report (its probes import torch only when they run), the memory picture's file (``plot``) and
whether the engines' stop hub caught a signal (``stop``). Importing this package imports none of
them; none imports torch at import time (tests/unit/test_layout_and_imports.py)."""
