"""Tools around the dispatch runtime: the benchmark (`moe-ar-bench`), the soak (`moe-ar-soak`), the
float64 reference the tests, soak and benchmark check against, the reliability summary, and probes
(`moe_ar_tools.probes`), the host-time and workspace-backend measurements. The runtime (`dispatch`) imports none of this.
"""
