"""What each worker of ``ddpgraph launch`` runs: the guards, then the user's script as ``__main__``.

Command line (built by :mod:`ddpgraph.distributed.launch`): ``python -m ddpgraph.distributed.launch_worker path SCRIPT
ARGS...`` or ``... module MODULE ARGS...``. Not a public interface.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from . import torch_patch
from .launch import RUN_MODULE, RUN_PATH
from .runtime import bind_device, read_launch_env

PREFIX = "[ddpgraph launch]"


def main(argv: Sequence[str] | None = None) -> None:
    mode, target, *script_args = sys.argv[1:] if argv is None else argv
    if mode not in (RUN_PATH, RUN_MODULE):
        raise SystemExit(f"{PREFIX} internal error: unknown mode {mode!r}; use `ddpgraph launch`.")
    install_guards()
    sys.argv = [target, *script_args]
    if mode == RUN_MODULE:
        # alter_sys: argv[0] becomes the module's file and __main__ the module, as with python -m
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # `python SCRIPT` puts the script's folder first on sys.path (for its sibling imports);
        # `python -m` put the working directory there instead.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def install_guards() -> str:
    """Bind this rank's device and patch torch's object collectives; return the summary line.

    Must run before the script does any CUDA work: ``set_device`` after a CUDA context exists on
    ``cuda:0`` would leave that context (and its memory) behind on every rank.
    """
    env = read_launch_env()
    device = bind_device(env.local_rank)
    torch_patch.patch_torch()
    bound = "device bound" if device.type == "cuda" else "no GPU, nothing to bind"
    summary = (
        f"{PREFIX} rank {env.rank}/{env.world_size} on {device}: {bound}, "
        "object collectives checked"
    )
    if env.rank == 0:
        print(summary, file=sys.stderr, flush=True)
    return summary


if __name__ == "__main__":
    main()
