"""The ``READY key=value ...`` line a worker prints on stdout once it serves (launchers and tests read it).

It goes out as one ``write`` of the whole line: ``print`` writes the text and its newline separately on
an unbuffered stream, and the launcher's own forwarding of the children's stderr into the same pipe then
landed between them, gluing the next log line to the pid (``pid=208342026-11-26 ...``). A pipe keeps a
single write of at most PIPE_BUF bytes whole.
"""

from __future__ import annotations

import os
import sys


def announce_ready(**fields: object) -> None:
    line = "READY " + " ".join(f"{key}={value}" for key, value in fields.items()) + "\n"
    sys.stdout.flush()  # anything printed before goes first
    os.write(sys.stdout.fileno(), line.encode())
