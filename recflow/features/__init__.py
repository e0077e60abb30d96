"""Raw columns -> int64 keys / dense tensors (hashing, splitting, normalizers)."""

from recflow.features.transform import normalize, serving_dtype, sparse_ids, transform

__all__ = ["normalize", "serving_dtype", "sparse_ids", "transform"]
