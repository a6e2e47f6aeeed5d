"""The one exception type for mistakes a user can fix.

The CLI prints a `UserError` as one paragraph without a traceback and exits with code 2. Everything else is a
bug in systolic and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: a config value, a path, a run directory. The message says what was wrong and how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """A config key, type or value that the schema rejects."""


class TrainingHalted(UserError):
    """Training stopped itself (non-finite loss or gradients); the last checkpoint is intact."""

    exit_code = 3


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""

    exit_code = 4


class CheckpointMismatch(UserError):
    """An intact checkpoint whose arrays do not fit the abstract state built from the run's config (another model
    size, another optimizer): a config mismatch, not damage. Callers re-raise it with their own fix."""

    def __init__(self, directory: object, step: int, detail: str):
        self.directory, self.step, self.detail = directory, step, detail
        super().__init__(f"The checkpoint {directory}/{step} does not match its config ({detail}). Nothing was changed. "
                         "Fix: use the settings it was saved with.")


class CheckpointDamaged(UserError):
    """A checkpoint step without its manifest (nothing to verify its checksums against) whose arrays do not load, or
    load with NaN/Inf: damaged, as a step that fails its checksums is. A resume sets it aside and falls back."""

    def __init__(self, directory: object, step: int, detail: str):
        self.directory, self.step, self.detail = directory, step, detail
        super().__init__(f"The checkpoint {directory}/{step} is damaged: it has no manifest to check its files against, "
                         f"and {detail}. Nothing was changed. Fix: resume the run (`systolic train`), which moves this "
                         "step aside and continues from the previous intact one, or move that step folder away by "
                         "hand, or restore the run directory from a backup.")
