"""The base of every error caused by the user's input (config, data, checkpoint paths).

The CLI prints these as one line, ``error: <cause>``, without a traceback.
"""


class UserInputError(ValueError):
    pass
