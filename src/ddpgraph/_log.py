"""The one ``ddpgraph`` logger, prefixed with the rank; rank 0 speaks at INFO, others at WARNING."""

from __future__ import annotations

import logging

_LOGGER_NAME = "ddpgraph"


def get_logger() -> logging.Logger:
    return logging.getLogger(_LOGGER_NAME)


def configure_logging(rank: int) -> None:
    """Give the logger a rank-prefixed handler unless the application configured one itself."""
    logger = get_logger()
    ours = [h for h in logger.handlers if getattr(h, "_ddpgraph", False)]
    if logger.handlers and not ours:
        return
    for handler in ours:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._ddpgraph = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(f"[ddpgraph rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
