"""``python -m ipc_dpsample``: the ``ipc-dpsample`` command line."""

from __future__ import annotations

import sys

from .tools.cli import main

if __name__ == "__main__":  # spawned ranks re-import this module as __mp_main__
    sys.exit(main())
