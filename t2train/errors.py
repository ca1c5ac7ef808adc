"""Errors the CLI prints as one line, ``error: <cause>``, without a traceback."""


class UserInputError(ValueError):
    """Caused by the user's input (config, data, checkpoint paths): exit code 2."""


class TrainingHalted(RuntimeError):
    """Training cannot safely go on (e.g. updates skipped too often in a row): exit code 3.
    The last published checkpoint is intact."""
