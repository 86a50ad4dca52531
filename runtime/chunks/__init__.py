"""Chunk-based model-state management (ZeRO-3 chunks, tiers, buffers)."""
