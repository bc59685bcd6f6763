"""The CPU suite's own bookkeeping: the quick loop's list of slow tests names tests that exist."""

import subprocess
import sys
from pathlib import Path

from conftest import SLOW

HERE = Path(__file__).resolve().parent


def test_every_slow_entry_names_a_test():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(HERE)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ids = [line.split("/")[-1] for line in done.stdout.splitlines() if "::" in line]
    names = {(i.split("::")[0], i.split("::")[1]) for i in ids}
    functions = {(module, name.split("[")[0]) for module, name in names}
    stale = [f"{module}::{name}" for module, entries in SLOW.items() for name in entries
             if (module, name) not in names and (module, name) not in functions]
    assert not stale, f"tests/cpu/conftest.py SLOW names no test: {stale}"
