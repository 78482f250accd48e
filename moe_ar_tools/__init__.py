"""Tools around the dispatch runtime: the benchmark (`moe-ar-bench`), the soak (`moe-ar-soak`), the
float64 reference the tests, soak and benchmark check against, the reliability summary, probes
(`moe_ar_tools.probes`), the host-time and workspace-backend measurements, and the SASS comparison
of two revisions (`sass_diff`). The runtime (`dispatch`) imports none of this.
"""
