"""The data a training loop feeds the engine: batches (moved to the device, counted, their loss
found: ``batches``), this rank's resumable sampler (``sampler``) and the DataLoader over it whose
position checkpoints save (``loaders``)."""
