"""Holds a model dir's writer lock (as `recflow train` does) until killed; prints
`held` once it has it.

Usage: python hold_writer_lock.py MODEL_DIR
"""

import sys
import time

from recflow.training.lock import writer_lock

with writer_lock(sys.argv[1], "train"):
    print("held", flush=True)
    time.sleep(600)
