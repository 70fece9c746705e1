"""The error a config file or an override can give: one line that locates the problem."""

from __future__ import annotations

__all__ = ["ConfigError", "Key"]

Key = tuple[str, ...]


class ConfigError(ValueError):
    """A problem in a config file or an override, located as precisely as possible.

    ``str(err)`` is the single line a user sees (no traceback): ``CONFIG:LINE: key: message``,
    with LINE left out when unknown and ``--set KEY=VALUE`` as the location of override errors.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        self.path, self.line, self.key, self.message = path, line, key, message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.path or ""
        if where and self.line is not None:
            where += f":{self.line}"
        return ": ".join(part for part in (where, self.key, self.message) if part)
