"""The sections of ``scripts/gpu_check.py``: one module each, a ``SECTION`` in every one."""
