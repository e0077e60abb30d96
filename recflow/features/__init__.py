"""Raw columns -> int64 keys / dense tensors (hashing, splitting, normalizers).

The transforms import TensorFlow on first use; `recflow.data.fit.fit_normalizer`
does not.
"""

_LAZY = {"serving_dtype", "sparse_ids", "transform"}


def __getattr__(name):
    if name in _LAZY:
        from recflow.features import transform as module

        return getattr(module, name)
    raise AttributeError(f"module 'recflow.features' has no attribute {name!r}")


__all__ = ["serving_dtype", "sparse_ids", "transform"]
