"""What each optimizer update reports beyond the loss, named as torchtitan names it where it has
a name: model FLOPs and MFU (``flops``, ``peak_flops``), the step time split into phases
(``phases``), device, host and SSD memory (``memory``), the record they make (``update_metrics``)
and the trackers it goes to (``trackers``: TensorBoard, Weights & Biases). Rank 0 only; nothing
here waits for the device: readings are taken after the one synchronisation per update the engine
already makes.
"""
