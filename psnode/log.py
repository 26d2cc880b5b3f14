"""The runtime's logger: quiet unless ``PS_VERBOSE`` asks (1: INFO, 2: DEBUG), always on stderr."""

from __future__ import annotations

import logging
import sys

__all__ = ["logger", "setup_logging"]

logger = logging.getLogger("psnode")


def setup_logging(verbose: int) -> None:
    """Log to stderr at INFO (PS_VERBOSE=1) or DEBUG (2); nothing at 0."""
    if verbose <= 0 or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[psnode %(asctime)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
