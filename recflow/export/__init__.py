"""Serving module, SavedModel writing, versioned export dirs.

The package is callable: `recflow.export(config_or_path, model_dir=None,
overrides=None, delta=False)` is `recflow.api.export` (a module attribute
named `export` could not be told apart from this subpackage once imported).
"""

import sys
import types

from recflow.export.saved_model import (
    Exporter,
    ServingModule,
    existing_versions,
    export_saved_model,
)


class _CallableModule(types.ModuleType):
    def __call__(self, config_or_path, model_dir=None, overrides=None, delta=False):
        from recflow.api import export

        return export(config_or_path, model_dir=model_dir, overrides=overrides, delta=delta)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Exporter", "ServingModule", "existing_versions", "export_saved_model"]
