"""The exception types users see for their own mistakes, and for runs that judged nothing.

Every one is an AccumcheckError: the CLI prints it as one line and exits with code 2, the pytest
plugin fails the test with the line, library callers get it raised.
"""


class AccumcheckError(Exception):
    """A usage or configuration error: the message says what was wrong and how to fix it."""


class NothingJudgedError(AccumcheckError):
    """A run in which nothing was judged: no parameter received a gradient, no optimizer step was
    checked, no micro-batch was seen. Never a pass: the message says what was not judged and the
    likely fix."""


class UserCodeError(AccumcheckError):
    """The user's own code raised (the batches, the model, the loss, ``step``, a hook, a setup
    file): the message names where (the micro-batch, the function) and the exception; the original
    exception is chained as ``__cause__``."""


class RankFailed(RuntimeError):
    """A rank of a job accumcheck started ended with an internal error: the message is the rank's
    own line (naming the rank and where its traceback was saved), told as it is, exit code 3."""


# What user code may raise that is the user's to answer for: every Exception, and SystemExit (a
# ``sys.exit()`` or an argparse error in the user's code). KeyboardInterrupt stays an interrupt.
USER_EXCEPTIONS = (Exception, SystemExit)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (SystemExit: its code), cut to ``limit``."""
    if isinstance(exc, SystemExit):
        return f"exit code {exc.code!r}"
    lines = str(exc).strip().splitlines()
    return lines[0].rstrip(".")[:limit] if lines else "no message"
