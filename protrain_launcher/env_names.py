"""Names of the environment variables the launcher sets for its ranks (no imports: the rank
entry point reads them before anything heavy is loaded)."""

LAUNCHER_PID_ENV = "PROTRAIN_LAUNCHER_PID"
"""The launcher's pid; a rank whose parent is already someone else exits at once."""
