"""The one exception type users see for their own mistakes."""


class AccumcheckError(Exception):
    """A usage or configuration error: the message says what was wrong and how to fix it.

    The CLI prints it as one line and exits with code 2; library callers get it raised.
    """
