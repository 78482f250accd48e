"""python -m moe_ar_tools.bench_one: the command of moe_ar_tools.bench_one.cli (moe-ar-bench-one)."""
from moe_ar_tools.bench_one.cli import main

if __name__ == "__main__":
    main()
