"""`gen-programs tune` / `python -m moe_ar_tools.tune`: the selection tables of this machine.

Measures every base program of the ladder in each cell this machine can run (world size 1 on one
GPU, world sizes up to the GPU count with real ranks, one process a GPU), each checked against the
float64 reference before it is timed, each point's time the slowest rank's; writes the measurements
with their stamp and the fitted table set into one file, which the runtime takes as a user's own set
(`tables=`, $MOE_AR_TABLES) and the generator as a committed one (generator/table_sets.py).

    units.py   what to measure: (world size, dtype, shape, T, profile) units
    loop.py    the loop: resume from the output file, the time budget, progress, the slowest rank
    output.py  the file: stamp, measurements, units done, the fitted set
    gpu.py     one rank's measurements (a GPU): workspace, inputs, reference, CUDA-graph timing
    cli.py     the command: what this machine can run, the phases, one process a GPU
"""
