"""protrain-run: the launcher (spec validation, overrides, elastic launch, signals)."""
