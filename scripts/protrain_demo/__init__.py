"""The demo's model and data, outside the product package: a small GPT built from a config
object (``gpt.py``) and a byte-level corpus of text that ships with Python (``corpus.py``).
``make demo``, the benchmarks, the GPU checks and the tests train them; ProTrain itself never
imports them. Importable with ``scripts/`` on the path, as every script and test runs."""
