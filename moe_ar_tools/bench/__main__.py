"""python -m moe_ar_tools.bench: the command of moe_ar_tools.bench.cli (moe-ar-bench)."""
from moe_ar_tools.bench.cli import main

if __name__ == "__main__":
    main()
