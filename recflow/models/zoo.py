"""Imports every built-in model so that the registry knows them."""

from recflow.models import deepfm  # noqa: F401
