"""Data: the built-in sets, datasets loading and tokenizing, collators, samplers.
"""
