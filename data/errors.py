"""The one error type of the data layer.

A ``DataError`` is always caused by the user's input (a path, a file's content, a dataset that
does not match the run), so it derives from ``UserInputError`` and the CLI prints it as a single
``error: <cause>`` line instead of a traceback.
"""

from t2train.errors import UserInputError


class DataError(UserInputError):
    """Bad data input; the message names the file, field or value and what was expected."""
