"""``python -m fastddp [options] script.py [args]``: see fastddp.launcher."""

import sys

from fastddp.launcher import main

if __name__ == "__main__":
    sys.exit(main())
