"""Several processes: the distributed state and world-size guard, rank agreement (a callback),
the launcher, sharding plugins, and stop signals.
"""
