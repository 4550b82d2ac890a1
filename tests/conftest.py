"""Puts tests/ on sys.path, so every test directory imports the shared multi-rank
machinery (tests/_ranks.py) however pytest is pointed at them."""

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
