"""Tools around the dispatch runtime: the benchmark (`moe-ar-bench`, every world size: `bench/`), the
soak (`moe-ar-soak`), the float64 reference the tests, soak and benchmark check against, the
reliability summary, the host-time and workspace-backend measurements, the table tuning (`tune`),
the stamp of every result (`provenance`, `stamp`) and the SASS comparison of two revisions
(`sass_diff`). The runtime (`dispatch`) imports none of this.
"""
