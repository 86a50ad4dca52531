"""Activation management: per-block modes and the SSD activation tier."""
