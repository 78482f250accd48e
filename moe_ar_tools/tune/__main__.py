"""python -m moe_ar_tools.tune: see moe_ar_tools/tune/cli.py. `gen-programs tune` runs this module with
MOE_AR_TUNE_PROG_NAME set, so that its --help and errors name the command the user typed."""
import os

from moe_ar_tools.tune.cli import main

if __name__ == "__main__":
    main(prog_name=os.environ.get("MOE_AR_TUNE_PROG_NAME") or None)
