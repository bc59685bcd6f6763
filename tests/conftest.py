import os
import sys

# The shared helpers (tests/cpu/ranks.py, problems.py) are imported by the CPU and GPU
# test modules and by the spawned rank processes alike.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpu"))
# A hardware queue per stream for the virtual ranks' streams (symm.VirtualGroup); read
# when CUDA starts, so set before any test touches the GPU.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import cpu_compat  # noqa: E402  (tests/cpu)

cpu_compat.apply()
