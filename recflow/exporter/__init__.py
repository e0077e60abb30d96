"""Serving module, SavedModel writing, versioned export dirs.

(The package is `exporter`, not `export`: `recflow.export(...)` is the Python API's
export function, `recflow.api.export`.)
"""

from recflow.exporter.saved_model import (
    Exporter,
    ServingModule,
    existing_versions,
    export_saved_model,
)

__all__ = ["Exporter", "ServingModule", "existing_versions", "export_saved_model"]
