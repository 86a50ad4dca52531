"""Everything that watches the engine train, behind one interface the Engine calls
(``observer.UpdateObserver``): the console and the metrics file (``console``, ``reporting``),
each update's metrics (model FLOPs and MFU, the step's phases, device, host and SSD memory,
named as torchtitan names them: ``flops``, ``peak_flops``, ``phases``, ``memory``,
``update_metrics``) and the trackers they go to (``trackers``: TensorBoard, Weights & Biases),
the run folder (``run_folder``), and what ``logging.trace`` records: a Chrome trace of a few
updates on every thread and the memory timeline ``protrain-run --plot`` draws (``trace_window``,
``profiling``, ``memory_timeline``, ``timeline_file``). Rank 0 measures; nothing here waits for
the device beyond the one synchronisation per update the engine already makes, and a failure to
write is said, never raised into training."""
