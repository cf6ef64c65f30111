"""``python -m sweeper``: see sweeper.cli."""

import sys

from sweeper.cli import main

if __name__ == "__main__":
    sys.exit(main())
