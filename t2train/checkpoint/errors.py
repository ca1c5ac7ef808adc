"""The errors of checkpoints: one that cannot be used (one line naming the path and cause),
and a state that must not be saved."""

from t2train.errors import UserInputError


class CheckpointError(UserInputError):
    pass


class NonFiniteState(RuntimeError):
    """The parameters or optimizer state hold NaN or inf: the save fails on every rank alike
    (``integrity.check_finite``) and nothing is published."""
