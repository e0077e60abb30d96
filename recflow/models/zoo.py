"""Imports every built-in model so that the registry knows them."""

from recflow.models import dcn, deepfm, din, mmoe, two_tower, wide_deep  # noqa: F401
