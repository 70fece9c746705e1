"""The session layer: a Session trains in a background thread and is the one door the
front-ends use (snapshots, events, commands, checkpoints, inspection).
"""
