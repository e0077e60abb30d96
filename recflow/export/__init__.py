"""Serving module, SavedModel writing, versioned export dirs."""

from recflow.export.saved_model import (
    Exporter,
    ServingModule,
    existing_versions,
    export_saved_model,
)

__all__ = ["Exporter", "ServingModule", "existing_versions", "export_saved_model"]
