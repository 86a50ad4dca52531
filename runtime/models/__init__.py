"""Small models that ship with ProTrain (no downloads)."""
