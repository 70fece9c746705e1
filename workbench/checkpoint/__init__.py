"""Checkpoints and the output directory: the store (atomic publish, manifest, catalog,
rotation), trainer-state save/load, state dicts, the background writer, the output_dir lock.
"""
