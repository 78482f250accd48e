"""Small shapes, few tokens: ours as committed, ours with one vector a thread (vec_per_thread=1), and
ours compiled for the call's shape (hidden, top_k, scale kind, row split as compile-time constants:
a text substitution over the inlined source), against the Triton kernel. One process a variant and shape.
    PYTHONPATH=. python experiments/world_size_1/shape_constants/probe.py {base,vpt1,spec} SHAPE OUT [--triton]"""
import sys, re
variant, shape, out = sys.argv[1:4]
systems = "ours,triton_fused" if "--triton" in sys.argv else "ours"
H, K = int(shape.split(":")[0]), int(shape.split(":")[1])
from dispatch import registry
if variant == "vpt1":
    from moe_ar_tools.bench.world_one import systems as S
    import dispatch
    def workspace(self, hidden):
        if hidden not in self.workspaces:
            self.workspaces[hidden] = dispatch.LocalWorkspace(max_tokens=max(self.cfg.tokens), hidden=hidden,
                                                              dtype=self.dtype, vec_per_thread=1)
        return self.workspaces[hidden]
    for name in dir(S):
        c = getattr(S, name)
        if isinstance(c, type) and hasattr(c, "workspace"):
            c.workspace = workspace
if variant == "spec":
    orig = registry._manifest.source_for
    SUBS = [("p.hidden", "MOE_H(p)"), ("p.top_k", "MOE_K(p)"), ("p.vec_per_thread", "MOE_VPT(p)"),
            ("blockDim.x", "MOE_THREADS"), ("p.scale_kind", "MOE_SK(p)")]
    macros = (f"#define MOE_H(p) {H}\n#define MOE_K(p) {K}\n#define MOE_VPT(p) 2\n"
              f"#define MOE_THREADS ((__builtin_assume(threadIdx.x < {H // 16})), {H // 16})\n#define MOE_SK(p) 1\n")
    def source_for(manifest, d, name):
        s = orig(manifest, d, name)
        if not name.startswith("moe_ar_local_") or "streaming" in name:
            return s
        for a, b in SUBS:
            s = s.replace(a, b)
        i = s.index("namespace moe_ar")
        return s[:i] + macros + s[i:]
    registry._manifest.source_for = source_for
    ok = registry._cache_key
    registry._cache_key = lambda source, target: ok(source, target) + "spec"
from moe_ar_tools.bench.cli import main
main(["--world", "1", "--shapes", shape, "--tokens", "1,16,64,128,256", "--profiles", "plain,fp8_tensor,nvfp4",
      "--systems", systems, "--compile-modes", "dynamic", "--no-programs", "--budget-s", "60", "--out", out],
     standalone_mode=False)
