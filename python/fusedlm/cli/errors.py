"""The one error the command line reports without a traceback."""


class UsageError(Exception):
    """Bad input from the user (a missing corpus, a directory that is not a checkpoint, a
    device that is not there, ...): printed as one line on stderr, exit status 2."""
