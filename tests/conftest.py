"""Shared fixtures: quiet TensorFlow, Keras 2, small configs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import recflow  # noqa: E402,F401  (selects Keras 2 before TensorFlow loads)


def fingerprint_ids(strings) -> list[int]:
    """The ids recflow gives strings, worked out without recflow: each string's
    `Fingerprint64` as int64, pieced together from `to_hash_bucket_fast` (which
    reduces that fingerprint mod its bucket count): its low 62 bits (mod 2**62),
    then which of the four fingerprints with those bits leaves the right
    remainder mod 2**63 - 1 (the four leave distinct ones)."""
    import tensorflow as tf

    strings = list(strings)
    if not strings:
        return []
    low = tf.strings.to_hash_bucket_fast(strings, 2**62).numpy().tolist()
    rem = tf.strings.to_hash_bucket_fast(strings, 2**63 - 1).numpy().tolist()
    out = []
    for lo, r in zip(low, rem):
        (fp,) = [lo + k * 2**62 for k in range(4) if (lo + k * 2**62) % (2**63 - 1) == r]
        out.append(fp - 2**64 if fp >= 2**63 else fp)
    return out
