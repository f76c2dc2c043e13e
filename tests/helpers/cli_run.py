"""dflash-run of the installation running the tests, as a process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run(*args, stdin=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([RUN, *args], input=stdin, capture_output=True, text=True, env=env, timeout=300)


RUN = str(Path(sys.executable).with_name("dflash-run"))
