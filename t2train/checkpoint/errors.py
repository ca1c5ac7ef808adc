"""The error a checkpoint that cannot be used raises: one line naming the path and cause."""

from t2train.errors import UserInputError


class CheckpointError(UserInputError):
    pass
