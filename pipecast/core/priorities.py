"""Package priorities: how much of a node's link a package's multicast may take (``multicast_share`` for
the default, ``priority_shares`` per priority). A deployment names its package's priority; the control
plane passes it to every agent in the package's plans."""

#: Highest first.
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"
