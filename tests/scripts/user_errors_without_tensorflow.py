"""Runs CLI commands that fail on user input (run in a folder holding bad.yaml, whose
features[0].dim is -3, and nodata.yaml, whose CSV lacks `price`); prints whether
TensorFlow was imported, then the exit codes.

Usage: python user_errors_without_tensorflow.py   (in that folder)
"""

import sys

from recflow.cli import main

codes = [
    main(["train", "bad.yaml"]),
    main(["evaluate", "bad.yaml"]),
    main(["export", "bad.yaml", "--delta"]),
    main(["plan", "bad.yaml"]),
    main(["train", "nodata.yaml"]),
    main(["plan", "missing.yaml"]),
    main(["train", "nodata.yaml", "--set", "oops"]),
    main(["data", "synth", "--out", "synth", "--rows", "0"]),
]
print("tensorflow" in sys.modules, codes)
