"""Names of the environment variables the launcher sets for its ranks (no imports: the rank
entry point reads them before anything heavy is loaded)."""

LAUNCHER_PID_ENV = "PROTRAIN_LAUNCHER_PID"
"""The launcher's pid; a rank whose parent is already someone else exits at once."""

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Set by torch's elastic agent: where a rank records why it failed (read back by the launcher)."""

BAD_INPUT_PREFIX = "bad input: "
"""How a rank that stopped on bad input (exit code 2) begins the message in its error file; the
launcher prints what follows as its own error."""

LOCAL_RANK_ENV = "PROTRAIN_LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "PROTRAIN_LOCAL_WORLD_SIZE"
"""One Slurm task per GPU: each task's agent runs one rank, which torch's agent numbers local
rank 0 of 1; the rank entry puts the task's place on its node (``SLURM_LOCALID``, the node's
task count) into ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` instead, for the device and the host's
share."""
