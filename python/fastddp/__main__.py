"""``python -m fastddp [options] script.py [args]``: see fastddp.launch.launcher."""

import sys

from fastddp.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
