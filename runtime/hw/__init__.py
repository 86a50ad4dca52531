"""The hardware layer: what the rest of the runtime knows of the machine. The device (streams,
events, pinned memory, memory statistics: real on CUDA, a faithful stand-in on CPU) and its
budget wall, host memory regions, collectives, direct disk I/O and durable files, the memory
counter, NVML, host capacity, and the stream-chaos and sanitizer switches that test the pipeline.
It imports nothing else of the runtime (tests/unit/test_layout_and_imports.py)."""
