"""python -m moe_ar_tools.bench: the command of moe_ar_tools.bench.cli. The objects handed to the
spawned workers live in the package's modules (picklable by name), not in __main__."""
from moe_ar_tools.bench.cli import main

if __name__ == "__main__":
    main()
