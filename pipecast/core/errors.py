"""The root of pipecast's typed exceptions.

Every error a user can cause (bad input, a bad peer, a missing file) derives from :class:`PipecastError`,
so entry points can turn it into a clear message and exit code 2 without a traceback.
"""


class PipecastError(Exception):
    """Base class of every expected pipecast failure."""
