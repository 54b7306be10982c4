"""A stand-in torchrun worker for the launcher's signal forwarding (tests/test_preempt.py): it marks itself
ready, waits for SIGTERM or SIGINT, records which one it got, and exits with the status given; a SIGUSR1
(the flight-recorder dump, forwarded too) leaves a ``.usr1`` mark and does not stop it.

    python -m tests.preempt_child FOLDER STATUS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    folder, status = Path(sys.argv[1]), int(sys.argv[2])
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: got.append(signum))
    rank = os.environ["RANK"]
    signal.signal(signal.SIGUSR1, lambda signum, frame: (folder / f"rank{rank}.usr1").write_text(""))
    (folder / f"rank{rank}.ready").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    (folder / f"rank{rank}.got").write_text(",".join(signal.Signals(s).name for s in got))
    return status


if __name__ == "__main__":
    sys.exit(main())
