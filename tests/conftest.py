"""Shared fixtures: quiet TensorFlow, Keras 2, small configs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import recflow  # noqa: E402,F401  (selects Keras 2 before TensorFlow loads)
