import os
import sys

# The rank helpers (tests/cpu/ranks.py) are imported by test modules and by the
# spawned rank processes alike.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpu"))

from titan_megamoe import cpu_compat  # noqa: E402

cpu_compat.apply()
