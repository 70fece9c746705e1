"""Resolve ``"module:attribute"`` and ``"path/file.py:attr"`` references written in a config.

A config names user code (model factories, hooks, callbacks) by reference. Those references
resolve against the config file's folder first, then the working directory, so a ``hooks.py`` kept next to the config works no matter where the run starts.
This module does only that: parse the reference, import its module without leaving
``sys.path`` changed, walk the attribute path, and say how to record the reference so the
resolved config repeats the run from anywhere. It knows nothing about config keys or line
numbers: problems are raised as :class:`RefError` with a message, and the caller (the config
loader) attaches the location.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

from workbench.config.toml_lines import kind_of

__all__ = ["RefError", "resolve_ref"]

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class RefError(ValueError):
    """A reference that cannot be resolved; ``str(err)`` is the message to show the user.

    It carries no location: the caller knows which config key held the reference.
    """


def resolve_ref(ref: str, base_dir: Path, *, need_callable: bool) -> tuple[Any, str]:
    """Import ``"module:attr.sub"`` (or ``"path/to/file.py:attr"``); return it and its recorded form.

    Modules are looked up in ``base_dir`` (the config's folder) first, then the working
    directory; a relative file path is taken from ``base_dir``. A module found under
    ``base_dir`` is recorded by its absolute file path, so the resolved config in
    ``output_dir`` imports the same code from anywhere; any other reference is recorded as
    written. With ``need_callable`` the object must be callable. Raises :class:`RefError`.
    """
    module_name, _, attr = ref.rpartition(":")
    is_file = module_name.endswith(".py")
    if not (is_file or _DOTTED.fullmatch(module_name)) or not _DOTTED.fullmatch(attr):
        raise RefError(f'{ref!r} must look like "module:attribute" (e.g. "hooks:compute_metrics")')
    module = _import_file(module_name, base_dir) if is_file else \
        _import_module(module_name, module_name, [str(base_dir), os.getcwd()])
    obj = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = f"module {module_name!r}" if i == 0 else f"{module_name}:{'.'.join(parts[:i])}"
            raise RefError(f"{owner} has no attribute {part!r}") from None
    if need_callable and not callable(obj):
        raise RefError(f"{ref!r} is not callable (it is {kind_of(obj)})")
    file = getattr(module, "__file__", None)
    recorded = ref
    if file and os.path.abspath(file).startswith(str(base_dir) + os.sep):
        recorded = f"{os.path.abspath(file)}:{attr}"
    return obj, recorded


def _import_file(spec: str, base_dir: Path) -> types.ModuleType:
    """Import a module given by file path; its package (folders with __init__.py) is kept.

    The path is tried relative to ``base_dir`` first, then to the working directory.
    Importing by dotted name from the package's parent folder (rather than loading the file
    on its own) keeps relative imports inside the package working.
    """
    file = Path(os.path.normpath(os.path.join(base_dir, os.path.expanduser(spec))))
    if not file.is_file() and Path(spec).absolute().is_file():
        file = Path(spec).absolute()
    if not file.is_file():
        raise RefError(f"cannot import module {spec!r} (file {str(file)!r} does not exist)")
    parts = [] if file.name == "__init__.py" else [file.stem]
    folder = file.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return _import_module(spec, ".".join(parts), [str(folder)])


def _import_module(shown: str, name: str, folders: list[str]) -> types.ModuleType:
    """Import ``name`` with ``folders`` first on sys.path (restored afterwards).

    ``shown`` is the reference as the user wrote it, for the error message. Any exception
    the module raises while importing becomes a :class:`RefError`: a broken hook module is
    a config problem, not a crash.
    """
    _forget_shadowed(name.split(".")[0], folders)
    importlib.invalidate_caches()
    sys.path[:0] = folders
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a broken hook module is a config problem, not a crash
        reason = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise RefError(f"cannot import module {shown!r} ({reason})") from None
    finally:
        for folder in folders:
            if folder in sys.path:
                sys.path.remove(folder)


def _forget_shadowed(top: str, folders: list[str]) -> None:
    """Drop a cached module ``top`` when the config's folder holds a different module of that name.

    Without this, a second config whose ``hooks.py`` differs from the first one's (same
    process: tests, notebooks) would silently get the first one's functions.
    """
    cached = sys.modules.get(top)
    if cached is None or top in sys.stdlib_module_names or top == "workbench":
        return
    for folder in folders:
        for candidate in (Path(folder, f"{top}.py"), Path(folder, top, "__init__.py")):
            if candidate.is_file():
                cached_file = getattr(cached, "__file__", None)
                if cached_file is None or os.path.realpath(cached_file) != os.path.realpath(candidate):
                    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                        del sys.modules[name]
                return
