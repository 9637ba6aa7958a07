"""Peak RSS growth of a piece of work, measured in a fresh Python process.

VmHWM (this process's peak RSS since exec), not ru_maxrss: a child's ru_maxrss starts
at its parent's peak, which would hide the growth being measured. ``warm`` runs first
(imports, first use of a library), then the baseline is taken, then ``work``; both are
Python source with ``argv`` (the strings given) in scope.
"""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
warm, work, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
exec(warm)
before = hwm()
exec(work)
print(json.dumps({"growth_bytes": hwm() - before}))
"""


def peak_growth(warm: str, work: str, *argv: str, timeout_s: float = 600) -> int:
    """Bytes the peak RSS of a fresh process grew by while it ran ``work``."""
    r = subprocess.run([sys.executable, "-c", _SCRIPT, warm, work, *argv],
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout.strip().splitlines()[-1])["growth_bytes"])
