// cuflash float32 (SIMT) building blocks shared by the FA2 float32 kernels (forward.cu, backward.cu) and
// FA1's (fa1.cu): key/value tiles through shared memory, one warp per query row. Include after
// cuflash_tiles.cuh and variants.cuh (the backward tile takes a variant's BlockInfo).
#pragma once

namespace cuflash {

// ---------------------------------------------------------------------------------------------------
// float32 inputs (plain SIMT arithmetic, no tensor cores): one warp per query row.

// K_j, V_j (kBlockN rows from n0; rows past seqlen_k as zeros) to shared memory as float32, K's rows
// kKStride floats apart (kHeadDim + 1 where lane j reads row j: bank (j + c) % 32, no conflict).
template <int kBlockN, int kHeadDim, int kKStride, int kThreads>
__device__ __forceinline__ void load_kv_f32(float* sK, float* sV, const float* kg, i64 k_ss, const float* vg, i64 v_ss,
                                            int n0, int seqlen_k, int tid) {
    for (int e = tid; e < kBlockN * kHeadDim; e += kThreads) {
        const int r = e / kHeadDim, c = e % kHeadDim;
        const bool ok = n0 + r < seqlen_k;
        sK[r * kKStride + c] = ok ? kg[(i64)(n0 + r) * k_ss + c] : 0.f;
        sV[r * kHeadDim + c] = ok ? vg[(i64)(n0 + r) * v_ss + c] : 0.f;
    }
}

// One query row (sq, in shared memory) against the key tile [n0, n0 + kBlockN) held by load_kv_f32
// (kKStride = kHeadDim + 1), for a row that sees keys [k_first, k_end) of which at least one lies in the
// tile: lane j scores key n0 + j [fa2-fwd 2] (raw score through mod(s, key) first: a variant's
// [variant mod]), warp reductions give the new max and the rescale [fa2-fwd 3] and the sum of P
// [fa2-fwd 4], and lane c adds P V_j into elements c, c + 32, ... of acc = l * O [fa2-fwd 5].
// m (scale * log2(e) units) and l are the row's running max and sum.
// drop(p, key): P as it enters P V ([variant dropout]: 0 for a dropped score; the row sum keeps every P).
struct NoDrop {
    __device__ __forceinline__ float operator()(float p, int) const { return p; }
};
template <int kHeadDim, int kBlockN, class Mod, class Drop = NoDrop>
__device__ __forceinline__ void f32_row_step(const float* sq, const float* sK, const float* sV, int n0, int k_first,
                                             int k_end, float scale_log2, float (&acc)[kHeadDim / 32], float& m,
                                             float& l, int lane, Mod&& mod, Drop&& drop = Drop{}) {
    static_assert(kHeadDim % 32 == 0 && kBlockN >= 1 && kBlockN <= 32, "one lane per key of the tile");
    constexpr int kPer = kHeadDim / 32, kKStride = kHeadDim + 1;
    const bool valid = lane < kBlockN && n0 + lane < k_end && n0 + lane >= k_first;
    float s = -CUFLASH_INF;
    if (valid) {
        const float* krow = sK + lane * kKStride;
        float dot = 0.f;
#pragma unroll 8
        for (int d = 0; d < kHeadDim; ++d) dot = fmaf(sq[d], krow[d], dot);
        s = mod(dot, n0 + lane) * scale_log2;
    }
    const float m_new = fmaxf(m, warp_max(s));
    // A row whose keys so far are all masked (a bias of -inf) keeps m = -inf: subtract 0 instead (no NaN).
    const float m_use = m_new == -CUFLASH_INF ? 0.f : m_new;
    const float corr = exp2f(m - m_use);
    const float p = valid ? exp2f(s - m_use) : 0.f;
    l = l * corr + warp_sum(p);
    m = m_new;
    const float pv = valid ? drop(p, n0 + lane) : 0.f;
#pragma unroll
    for (int c = 0; c < kPer; ++c) acc[c] *= corr;
    const int nk = min(kBlockN, k_end - n0);
    for (int jj = 0; jj < nk; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, pv, jj);
        const float* vrow = sV + jj * kHeadDim;
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[c] = fmaf(pj, vrow[lane + 32 * c], acc[c]);
    }
}

// The arguments of the float32 backward kernels (fa1_bwd_f32_kernel, flash_bwd_dkdv_f32_kernel).
struct F32BwdArgs {
    const float* q;
    const float* k;
    const float* v;
    const float* dout;
    const float* lse;
    const float* delta;
    float* dq;   // float32 output, zeroed by the launcher (unused without a dQ update)
    float* dkv;  // float32 workspace (2, batch, heads_q, seqlen_k, d): dK, dV per query head
    int seqlen_q, seqlen_k, heads_q, group, batch;  // rows of the arrays (totals when packed); batch of dkv
    i64 q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh, dq_sb, dq_ss, dq_sh;
    float scale;
};

// How bwd_f32_key_tile adds dS K_j to dQ: not at all (the split order's dK/dV pass), read-modify-write
// (FA1: one block owns the (batch, head)), or atomicAdd (FA2: key tiles spread over blocks).
enum class DqUpdate { kNone, kReadModifyWrite, kAtomic };

// One key/value tile j of kBlockN rows of (batch b, query head h) of the sequence bi, 4 warps: each warp
// owns kBlockN / 4 key rows (dK, dV in registers, lane c holding head-dim elements c, c + 32, ...); the
// query rows that see the tile come one at a time for the whole block. Per row and key: [bwd 1]
// P = exp(scale mod(q.k) - lse) ([variant mod]) and [bwd 3] dP = dO.v (two warp reductions), [bwd 4]
// dS = P (dP - D) (times d mod / d s: [variant grad]), [bwd 2] dV += P dO, [bwd 6] dK += dS Q; [bwd 5]
// dQ_i += scale dS K_j, the four warps' partial rows summed in shared memory. At the end dK = scale dK_acc
// and dV go to args.dkv. smem: K, V (kBlockN x d each), Q and dO rows, 4 dQ rows.
template <int kHeadDim, int kBlockN, class V, DqUpdate kDq>
__device__ __forceinline__ void bwd_f32_key_tile(const F32BwdArgs& a, const BlockInfo<V>& bi, int j, int h, int b,
                                                 float* smem) {
    constexpr int kNWarps = 4, kThreads = 32 * kNWarps, kPer = kHeadDim / 32, kKW = kBlockN / kNWarps;
    static_assert(kHeadDim % 32 == 0 && kBlockN % kNWarps == 0 && kKW * kPer <= 32, "tile shape");
    float* sK = smem;                     // kBlockN x kHeadDim
    float* sV = sK + kBlockN * kHeadDim;  // kBlockN x kHeadDim
    float* sQ = sV + kBlockN * kHeadDim;  // one query row
    float* sdO = sQ + kHeadDim;           // its dO row
    float* sdQ = sdO + kHeadDim;          // kNWarps partial dQ rows
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, h_kv = h / a.group;
    const float* qg = a.q + b * a.q_sb + h * a.q_sh + (i64)bi.q0 * a.q_ss;
    const float* dog = a.dout + b * a.do_sb + h * a.do_sh + (i64)bi.q0 * a.do_ss;
    float* dqg = a.dq + b * a.dq_sb + h * a.dq_sh + (i64)bi.q0 * a.dq_ss;
    const int n0 = j * kBlockN;
    __syncthreads();  // every warp is done with the previous tile's shared memory
    load_kv_f32<kBlockN, kHeadDim, kHeadDim, kThreads>(sK, sV, a.k + b * a.k_sb + h_kv * a.k_sh + (i64)bi.k0 * a.k_ss,
                                                       a.k_ss, a.v + b * a.v_sb + h_kv * a.v_sh + (i64)bi.k0 * a.v_ss,
                                                       a.v_ss, n0, bi.len_k, tid);
    float dk_acc[kKW][kPer], dv_acc[kKW][kPer];
#pragma unroll
    for (int kk = 0; kk < kKW; ++kk) {
#pragma unroll
        for (int c = 0; c < kPer; ++c) dk_acc[kk][c] = dv_acc[kk][c] = 0.f;
    }
    // Query rows that see key tile j (causal, window).
    const int2 rows = bi.query_range(n0, n0 + kBlockN);
    for (int row = rows.x; row < rows.y; ++row) {
        __syncthreads();  // K_j, V_j landed (first row); the previous row's sQ, sdO, sdQ are consumed
        for (int c = tid; c < kHeadDim; c += kThreads) {
            sQ[c] = qg[(i64)row * a.q_ss + c];
            sdO[c] = dog[(i64)row * a.do_ss + c];
        }
        const i64 stat = bi.row_index(h, a.heads_q, a.seqlen_q, row);
        const float lse_i = a.lse[stat], d_i = a.delta[stat];
        const int2 keys = lse_i == -CUFLASH_INF ? make_int2(0, 0) : bi.key_range(row, row + 1);
        __syncthreads();
        float dq_part[kPer];
#pragma unroll
        for (int c = 0; c < kPer; ++c) dq_part[c] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKW; ++kk) {
            const int kr = warp * kKW + kk;  // row of the tile
            const int key = n0 + kr;
            if (key >= keys.x && key < keys.y) {  // warp-uniform
                const float* krow = sK + kr * kHeadDim;
                const float* vrow = sV + kr * kHeadDim;
                float s = 0.f, dp = 0.f;
#pragma unroll
                for (int c = 0; c < kPer; ++c) {
                    s = fmaf(sQ[lane + 32 * c], krow[lane + 32 * c], s);
                    dp = fmaf(sdO[lane + 32 * c], vrow[lane + 32 * c], dp);
                }
                float grad = 1.f;
                const float sm = bi.template mod<true>(warp_sum(s), row, key, grad);  // [variant mod]
                const float p = expf(sm * a.scale - lse_i);             // [bwd 1]
                // [variant dropout] P dropped (times 1 / (1 - p)) enters dV, and dP the same way enters dS.
                const float kp = V::Has_dropout ? (bi.keep(row, key) ? bi.keep_scale : 0.f) : 1.f;
                const float pd = p * kp;
                const float dt = p * (warp_sum(dp) * kp - d_i);         // [bwd 3], [bwd 4]
                // [variant grad] dbias (added after softcap, before a score_mod)
                if (lane == 0) bi.store_dbias(row, key, V::Mod::Has_score_mod ? dt * grad : dt);
                const float ds = dt * grad;                             // [variant grad] softcap
#pragma unroll
                for (int c = 0; c < kPer; ++c) {
                    dv_acc[kk][c] = fmaf(pd, sdO[lane + 32 * c], dv_acc[kk][c]);  // [bwd 2]
                    dk_acc[kk][c] = fmaf(ds, sQ[lane + 32 * c], dk_acc[kk][c]);  // [bwd 6]
                    dq_part[c] = fmaf(ds, krow[lane + 32 * c], dq_part[c]);      // [bwd 5]
                }
            }
        }
        if constexpr (kDq != DqUpdate::kNone) {
#pragma unroll
            for (int c = 0; c < kPer; ++c) sdQ[warp * kHeadDim + lane + 32 * c] = dq_part[c];
            __syncthreads();
            // [bwd 5] dQ_i += scale dS K_j in HBM.
            for (int c = tid; c < kHeadDim; c += kThreads) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < kNWarps; ++w) sum += sdQ[w * kHeadDim + c];
                float* dst = dqg + (i64)row * a.dq_ss + c;
                if constexpr (kDq == DqUpdate::kAtomic) {
                    atomicAdd(dst, a.scale * sum);
                } else {
                    *dst += a.scale * sum;
                }
            }
        }
    }
    // dK_j = scale dK_acc, dV_j to the per-query-head workspace (keys past the used ones stay as zeroed).
    const i64 plane = (i64)a.batch * a.heads_q * a.seqlen_k * kHeadDim;
#pragma unroll
    for (int kk = 0; kk < kKW; ++kk) {
        const int key = n0 + warp * kKW + kk;
        if (key >= bi.len_k) continue;
        float* dkr = a.dkv + bi.key_row_index(h, a.heads_q, a.seqlen_k, key) * kHeadDim;
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
            dkr[lane + 32 * c] = dk_acc[kk][c] * a.scale;
            dkr[plane + lane + 32 * c] = dv_acc[kk][c];
        }
    }
}

}  // namespace cuflash
