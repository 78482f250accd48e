"""python -m moe_ar_tools.bench_one: python -m moe_ar_tools.bench --world 1."""
from moe_ar_tools.bench_one import main

if __name__ == "__main__":
    main()
