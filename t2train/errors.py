"""Errors the CLI prints as one line, ``error: <cause>``, without a traceback, and their exit
codes."""


class UserInputError(ValueError):
    """Caused by the user's input (config, data, checkpoint paths): exit code 2."""

    exit_code = 2


class TrainingHalted(RuntimeError):
    """Training cannot safely go on (e.g. updates skipped too often in a row): exit code 3.
    The last published checkpoint is intact."""

    exit_code = 3


class RankFailure(TrainingHalted):
    """A failure this rank saw alone while its peers may wait for it in a collective: every
    rank ends with this message (t2train/train/rank_failures.py)."""


class ConfigError(UserInputError):
    """A configuration value is missing, malformed or inconsistent; the message names it."""


def require(ok: bool, field_name: str, value, rule: str) -> None:
    """Raise ``ConfigError("<field>=<value>: <rule>")`` unless ``ok``."""
    if not ok:
        text = repr(value)
        raise ConfigError(
            f"{field_name}={text if len(text) <= 200 else text[:197] + '...'}: {rule}"
        )
