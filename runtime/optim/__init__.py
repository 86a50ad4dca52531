"""Optimizer rules: what the chunk engine needs of an optimizer (its state, its kernel over one
flat shard), and the registry the spec's ``optimizer.type`` names one from."""
