"""Moved to :mod:`fedddl.flower.fast_supernode` (this path keeps working for one release).

``python -m fedddl.deploy.fast_supernode ...`` runs the same launcher.
"""

from __future__ import annotations

import sys

from fedddl.flower.fast_supernode import ScaledSleepTime, main, patch_supernode_polling

__all__ = ["ScaledSleepTime", "main", "patch_supernode_polling"]

if __name__ == "__main__":
    sys.exit(main())
