import os
import sys

# The shared helpers (tests/cpu/ranks.py, problems.py) are imported by the CPU and GPU
# test modules and by the spawned rank processes alike.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpu"))

from titan_megamoe import cpu_compat  # noqa: E402

cpu_compat.apply()
