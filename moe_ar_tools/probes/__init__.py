"""One-off GPU probes behind measurements in bench_results/: each reports, none asserts. Run one
with `python -m moe_ar_tools.probes.<name>`; its docstring gives the usage."""
