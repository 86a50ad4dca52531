"""Integrations with training loops that are not ProTrain's own: ``runtime.integrations.hf`` (the
Hugging Face ``Trainer``, and trainers built on it such as TRL's). Each module imports its
framework itself; importing this package imports none."""
