"""A job that starts a child process and outlives any test timeout, for ``tests/test_launch.py``.

    python -m tests.sleep_job PID_FILE

Writes the child's pid to ``PID_FILE`` and sleeps (a rank started by a launcher, then hung).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(120)
