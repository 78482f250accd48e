"""What the runtime and the generator read, carried by a wheel: no code.

pyproject.toml maps the repository's generated/, templates/ and the measurements the committed table
sets are fitted to (generator/table_sets.py COMMITTED_SETS, in bench_results/) into this package, in
the repository's layout:

    moe_ar_data/generated/      manifest.json, kernels/, programs/, tables/   (dispatch reads it)
    moe_ar_data/templates/      *.j2                                          (gen-programs renders them)
    moe_ar_data/bench_results/  the measurement files the table sets are fitted to

In a source checkout (or an editable install of one) this folder holds only this file: dispatch and
gen-programs read the checkout's own generated/, templates/ and bench_results/ instead.
"""
