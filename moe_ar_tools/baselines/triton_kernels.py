"""The Triton kernels of moe_ar_tools.baselines.triton_fused (which says what they compute); a module
of their own because Triton's jitted functions must be module globals and this one imports Triton."""
import triton
import triton.language as tl


@triton.jit
def _routed_sum(x_ptr, idx_ptr, w_ptr, t, rows, H, offs, mask, K: tl.constexpr, HAS_W: tl.constexpr,
                BLOCK: tl.constexpr):
    # sum_k w[t, k] * x[idx[t, k]] in fp32; a route < 0 or >= rows adds nothing
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(idx_ptr + t * K + k)
        ok = (row >= 0) & (row < rows)
        if HAS_W:
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
        else:
            w = 1.0
        xk = tl.load(x_ptr + tl.where(ok, row, 0).to(tl.int64) * H + offs, mask=mask & (offs * 0 + row >= 0) &
                     (offs * 0 + row < rows), other=0.0)
        acc += tl.where(ok, w, 0.0) * xk.to(tl.float32)
    return acc


@triton.jit
def _partial(x_ptr, idx_ptr, w_ptr, shared_ptr, t, rows, H, rsf, offs, mask, K: tl.constexpr, HAS_W: tl.constexpr,
             HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    # rsf * routed sum + the shared expert's row, fp32
    s = _routed_sum(x_ptr, idx_ptr, w_ptr, t, rows, H, offs, mask, K, HAS_W, BLOCK) * rsf
    if HAS_SHARED:
        s += tl.load(shared_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _norm_and_quant(r, t, H, offs, mask, gamma_ptr, norm_ptr, q_ptr, s_ptr, qscale_ptr, eps, weight_bias,
                    QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # r: residual_out in the dtype. RMSNorm -> norm_out (dtype); QUANT 1: FP8 group-128, row-major
    # float32 scales [T, H/128]; 2: FP8 with the per-tensor scale at qscale_ptr
    rf = r.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(rf * rf, axis=0), H.to(tl.float32))
    rstd = tl.math.rsqrt(mean + eps)
    g = tl.load(gamma_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((rf * rstd) * (g + weight_bias)).to(norm_ptr.dtype.element_ty)
    tl.store(norm_ptr + t * H + offs, y, mask=mask)
    if QUANT == 1:
        yf = y.to(tl.float32)
        amax = tl.max(tl.reshape(tl.abs(yf), [BLOCK // GROUP, GROUP]), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
        s_full = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK // GROUP, GROUP]), [BLOCK])
        q = tl.clamp(tl.math.div_rn(yf, s_full), -448.0, 448.0)
        tl.store(q_ptr + t * H + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        groups = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + t * (H // GROUP) + groups, scale, mask=groups < H // GROUP)
    if QUANT == 2:
        scale = tl.load(qscale_ptr)
        q = tl.clamp(tl.math.div_rn(y.to(tl.float32), scale), -448.0, 448.0)
        tl.store(q_ptr + t * H + offs, q.to(q_ptr.dtype.element_ty), mask=mask)

@triton.jit
def fused(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, q_ptr, s_ptr,
          qscale_ptr, rows, H, rsf, eps, weight_bias, K: tl.constexpr, HAS_W: tl.constexpr,
          HAS_SHARED: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = _partial(x_ptr, idx_ptr, w_ptr, shared_ptr, t, rows, H, rsf, offs, mask, K, HAS_W, HAS_SHARED, BLOCK)
    s += tl.load(res_in_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    r = s.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * H + offs, r, mask=mask)
    _norm_and_quant(r, t, H, offs, mask, gamma_ptr, norm_ptr, q_ptr, s_ptr, qscale_ptr, eps, weight_bias,
                    QUANT, BLOCK, GROUP)

@triton.jit
def gather_sum(x_ptr, idx_ptr, w_ptr, shared_ptr, out_ptr, rows, H, rsf, K: tl.constexpr, HAS_W: tl.constexpr,
               HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = _partial(x_ptr, idx_ptr, w_ptr, shared_ptr, t, rows, H, rsf, offs, mask, K, HAS_W, HAS_SHARED, BLOCK)
    tl.store(out_ptr + t * H + offs, s.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def add_rmsnorm(partial_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, q_ptr, s_ptr, qscale_ptr, H, eps,
                weight_bias, QUANT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    s = tl.load(partial_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(res_in_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    r = s.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * H + offs, r, mask=mask)
    _norm_and_quant(r, t, H, offs, mask, gamma_ptr, norm_ptr, q_ptr, s_ptr, qscale_ptr, eps, weight_bias,
                    QUANT, BLOCK, GROUP)
