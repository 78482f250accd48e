"""python -m moe_ar_tools.tune: see moe_ar_tools/tune/cli.py."""
from moe_ar_tools.tune.cli import main

if __name__ == "__main__":
    main()
