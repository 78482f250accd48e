"""python -m moe_ar_tools.soak: the command of moe_ar_tools.soak.cli."""
import sys

from moe_ar_tools.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
