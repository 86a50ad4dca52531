"""Checkpoints: the directory store, parameter-space state for DCP, random streams, save/load."""
