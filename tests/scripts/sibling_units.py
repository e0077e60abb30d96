"""The sibling module `sibling_tower.py` imports."""

UNITS = 3
