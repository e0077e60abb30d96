"""Serving module, SavedModel writing, versioned export dirs."""

from recflow.export.saved_model import ServingModule, existing_versions, export_saved_model

__all__ = ["ServingModule", "existing_versions", "export_saved_model"]
