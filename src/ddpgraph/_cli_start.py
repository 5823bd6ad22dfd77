"""Ctrl-C while the ``ddpgraph`` command still imports torch (a second or more): one line and
exit status 130, not a traceback through torch's import.

Imported first by ``ddpgraph/__init__.py``, before torch. It changes nothing in any process but
the command line's own (``ddpgraph ...`` or ``python -m ddpgraph ...``): a script that imports
ddpgraph keeps Python's KeyboardInterrupt. :func:`ddpgraph.cli.main` calls :func:`done` first,
so the commands themselves see Python's handler again.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from types import FrameType

from ._debug import debug_requested  # stdlib only: torch is not imported yet


def _is_the_command_line() -> bool:
    if sys.argv and os.path.basename(sys.argv[0]) == "ddpgraph":  # the console script
        return True
    argv = getattr(sys, "orig_argv", [])  # python -m ddpgraph ...
    return any(a == "-m" and b == "ddpgraph" for a, b in itertools.pairwise(argv))


def _interrupted(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write(f"ddpgraph: interrupted ({signal.Signals(signum).name}) while starting\n")
    sys.stderr.flush()
    os._exit(128 + signum)  # no unwinding through a half-imported torch


def install() -> None:
    """Take over SIGINT for the imports, where Python's own handler is in place."""
    if debug_requested() or not _is_the_command_line():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def done() -> None:
    """The imports are done: Python's handler again (KeyboardInterrupt, which the CLI reports)."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


install()
