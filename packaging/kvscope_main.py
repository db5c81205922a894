"""The frozen bundle's entry point (packaging/kvscope.spec): the `kvscope` command."""

import multiprocessing
import sys

from app.main import main

if __name__ == "__main__":
    # A frozen executable re-runs itself for multiprocessing's spawned children (torch, pyqtgraph).
    multiprocessing.freeze_support()
    sys.exit(main())
