"""Config files: TOML -> RunConfig (validated with line numbers), references, and the
build of a model, data and Trainer from a RunConfig.
"""
