"""``python -m cuflash``: the command line (:mod:`cuflash.cli.main`: ``demo``, ``bench``, ``bench-gpu``, ...)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
