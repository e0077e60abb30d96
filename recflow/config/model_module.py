"""Where the module of a `"module:ClassName"` config value is found, and its import.

Models (`model.type`), task heads (`task.type`), sparse and dense optimizers
(`...optimizer.type`) and feature kinds (`features[i].kind`) may name a class of
the user's own module as `"module:ClassName"`. A module on the Python path is
imported as usual. Otherwise it is looked for in the config file's folder, then in
the working directory, so an extension written next to its config runs without
setting PYTHONPATH. `locate` runs when the config is loaded, before TensorFlow is
imported (a misspelt module costs no wait); `import_class` imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys

from recflow.errors import ConfigError
from recflow.quiet import native_stderr_silenced

_FOLDERS: dict[str, str] = {}  # top-level module name -> the folder it was found in


def register(table: dict, name: str, cls, base: type | None, what: str) -> None:
    """Adds `cls` under `name` to a registry `table` (models, heads, feature kinds,
    sparse optimizers): the one check of every `register_*` decorator.

    Raises:
        TypeError: `cls` is not a subclass of `base` (when given).
        ValueError: `name` already names another class.
    """
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{cls!r} is not a {base.__name__} subclass")
    if table.get(name, cls) is not cls:
        raise ValueError(f"a {what} named {name!r} is already registered ({table[name]!r})")
    table[name] = cls


def is_class_path(type_name: object) -> bool:
    """Whether a config value names a class as `module:ClassName`."""
    return isinstance(type_name, str) and ":" in type_name


def locate(type_name: str, config_dir: str | None, path: str = "model.type") -> None:
    """Finds the top-level module of a `module:Class` name, remembering its folder.

    Raises:
        ConfigError: (naming `path`) the module is on the Python path, in `config_dir`
            and in the working directory nowhere.
    """
    module_name, sep, _ = type_name.partition(":")
    top = module_name.partition(".")[0]
    if not sep or not top or top in sys.modules or top in _FOLDERS:
        return  # a registered name, or a malformed one that `import_class` reports
    if importlib.util.find_spec(top) is not None:  # a top-level lookup runs no module code
        return
    cwd = os.getcwd()
    for folder in (config_dir, cwd):
        if folder and importlib.machinery.PathFinder.find_spec(top, [folder]) is not None:
            _FOLDERS[top] = folder
            return
    where = f"in the config's folder {config_dir}, " if config_dir and config_dir != cwd else ""
    raise ConfigError(
        path,
        f"no module {top!r} on the Python path, {where}or in the working directory {cwd}",
    )


def folder_of(module_name: str) -> str | None:
    """The folder `locate` found the top-level package of `module_name` in, if any."""
    return _FOLDERS.get(module_name.partition(".")[0])


@contextlib.contextmanager
def _importable_from(folder: str | None):
    """`folder` first on `sys.path` while a user module (and what it imports) loads."""
    if folder is None:
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above


def import_class(type_name: str, path: str, base: type | None = None, what: str = "") -> type:
    """Imports the class of `"module:ClassName"` (from the folder `locate` found it in).

    Args:
        type_name: the config value.
        path: the config path named by errors.
        base: when given, the class must subclass it (named `what` in the error).

    Raises:
        ConfigError: a malformed name, a module that does not import, no such class,
            or not a subclass of `base`.
    """
    module_name, _, class_name = type_name.partition(":")
    if not module_name or module_name.startswith(".") or not class_name:
        raise ConfigError(path, f"expected an absolute 'package.module:ClassName', got {type_name!r}")
    if "tensorflow" not in sys.modules:  # a user module imports it: without its native log lines
        with native_stderr_silenced():
            importlib.import_module("tensorflow")
    try:
        with _importable_from(folder_of(module_name)):
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(path, f"cannot import {module_name!r} ({e})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(path, f"module {module_name!r} has no class {class_name!r}")
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(path, f"{type_name!r} is not a {what or base.__name__} subclass")
    return cls
