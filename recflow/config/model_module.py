"""Where the module of `model.type: "module:ClassName"` is found.

A module on the Python path is imported as usual. Otherwise it is looked for in the
config file's folder, then in the working directory, so a tower written next to its
config runs without setting PYTHONPATH. The lookup runs when the config is loaded,
before TensorFlow is imported (a misspelt module costs no wait); the import itself is
done by `recflow.models.registry.get_model_class`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from recflow.errors import ConfigError

_FOLDERS: dict[str, str] = {}  # top-level module name -> the folder it was found in


def locate(type_name: str, config_dir: str | None) -> None:
    """Finds the top-level module of a `module:Class` name, remembering its folder.

    Raises:
        ConfigError: the module is on the Python path, in `config_dir` and in the
            working directory nowhere.
    """
    module_name, sep, _ = type_name.partition(":")
    top = module_name.partition(".")[0]
    if not sep or not top or top in sys.modules or top in _FOLDERS:
        return  # a registered name, or a malformed one that the registry reports
    if importlib.util.find_spec(top) is not None:  # a top-level lookup runs no module code
        return
    cwd = os.getcwd()
    for folder in (config_dir, cwd):
        if folder and importlib.machinery.PathFinder.find_spec(top, [folder]) is not None:
            _FOLDERS[top] = folder
            return
    where = f"in the config's folder {config_dir}, " if config_dir and config_dir != cwd else ""
    raise ConfigError(
        "model.type",
        f"no module {top!r} on the Python path, {where}or in the working directory {cwd}",
    )


def folder_of(module_name: str) -> str | None:
    """The folder `locate` found the top-level package of `module_name` in, if any."""
    return _FOLDERS.get(module_name.partition(".")[0])
