// cuflash FlashAttention(-1) kernels: the loop order of the first paper (Dao et al. 2022; seed 000
// Algorithm 4, seed 001 FlashForward / FlashBackward), mirroring cuflash/reference.py:fa1_forward and
// blocked_backward(order="kv_outer").
//
// What FA1 parallelizes over, and what it keeps in HBM (the point of these kernels; see
// docs/fa1-vs-fa2.md for the measured consequences):
//   - One thread block per (batch, query head): grid (heads_q, batch). The block walks every key/value
//     tile in the outer loop and every query tile it can see in the inner loop. Nothing else is split.
//   - Forward (fa1_fwd_kernel): the block holds K_j, V_j in shared memory; each warp takes its own query
//     tiles of kBlockM = 16 rows in turn (tiles first + warp, first + warp + kNWarps, ...) and, per tile,
//     [fa1-fwd 1] loads Q_i and reads the running O_i (float32, normalized), m_i, l_i from global memory,
//     [fa1-fwd 2..5] folds in S = Q_i K_j^T with the online-softmax update and P V_j,
//     [fa1-fwd 6] normalizes and writes O_i, m_i, l_i back. On the first key tile nothing is read (O = 0,
//     m = -inf, l = 0, as Algorithm 4's "else" branch); on the last key tile a query tile sees, O is
//     written in the output dtype and lse = m + log l instead of the float32 running state.
//   - Backward (fa1_bwd_kernel): key/value tiles of kBlockN = 16 * kNWarps rows outer (each warp keeps
//     dK, dV of 16 key rows in float32 registers), query tiles of kBlockM rows inner through a ring of
//     kStages cp.async buffers: [bwd 1] P^T, [bwd 2] dV += P^T dO, [bwd 3] dP^T, [bwd 4] dS^T,
//     [bwd 6] dK += dS^T Q, and [bwd 5] dQ_i += dS K_j read-modify-written in a float32 global
//     workspace at every step. The block owns its (batch, head) alone and every dQ element has one
//     owning thread, so there are no atomics. D = rowsum(dO O), the dQ scale/cast and the GQA dK/dV
//     group sum are the small kernels of backward.cu, shared with FA2.
//
// Shared memory (16-bit elements):
//   forward:  K, V kBlockN x d, plus per warp kStages Q tiles of 16 x d;
//             bytes = 2 d (2 kBlockN + 16 kNWarps kStages), e.g. d 128, kBlockN 64, 8 warps, 2: 96 KiB.
//   backward: K, V kBlockN x d; kStages x (Q, dO) kBlockM x d; float32 lse, D per stage; dS^T
//             kBlockN x kBlockM (the FA2 dK/dV kernel's layout with dQ).
//
// Running statistics are kept in log2 units (m' = scale log2(e) max S), as in the FA2 kernels.
#include "cuflash_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"
#include "f32_tiles.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------------
// Warp-level tile products on one 16-row mma tile (the row tile of the calling warp).

// c[16 x 8 kNT] += A B^T over the head dimension kK: A = rows a_row0 .. a_row0 + 15 of a [m][kK] tile,
// B = rows b_row0 .. b_row0 + 8 kNT - 1 of a [n][kK] tile (both swizzled, in shared memory).
template <class T, int kK, int kNT>
__device__ __forceinline__ void warp_mma_abt(float (&c)[kNT][4], const u16* sA, int a_row0, const u16* sB,
                                             int b_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        u32 a[4];
        load_a<kK>(a, sA, a_row0, kk, lane);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            u32 b[4];
            load_b_nk<kK>(b, sB, b_row0 + np * 16, kk, lane);
            Elem<T>::mma(c[2 * np], a, b[0], b[1]);
            Elem<T>::mma(c[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// c[16 x 8 kDT] += A B: A = one 16 x 16 fragment in registers, B = rows k0 .. k0 + 15 of a [k][kWidth] tile.
template <class T, int kWidth, int kDT>
__device__ __forceinline__ void warp_mma_a_kn(float (&c)[kDT][4], const u32 (&a)[4], const u16* sB, int k0, int lane) {
#pragma unroll
    for (int np = 0; np < kDT / 2; ++np) {
        u32 b[4];
        load_b_kn<kWidth>(b, sB, k0, np, lane);
        Elem<T>::mma(c[2 * np], a, b[0], b[1]);
        Elem<T>::mma(c[2 * np + 1], a, b[2], b[3]);
    }
}

// c[16 x 8 kDT] += P B: P = 16 x 8 kPT held as C fragments (rounded to T here, as the kernels and the
// reference do before every product with P or dS), B = rows 0 .. 8 kPT - 1 of a [k][kWidth] tile.
template <class T, int kWidth, int kPT, int kDT>
__device__ __forceinline__ void warp_mma_pb(float (&c)[kDT][4], const float (&p)[kPT][4], const u16* sB, int lane) {
#pragma unroll
    for (int kk = 0; kk < kPT / 2; ++kk) {
        u32 a[4];
        c_to_a<T, kPT>(a, p, kk);
        warp_mma_a_kn<T, kWidth, kDT>(c, a, sB, kk * 16, lane);
    }
}

// (batch, head) of this block, read with volatile asm: what is derived from them is recomputed where it is
// used instead of being hoisted out of the key/value loop and held in registers through the query loop,
// where dK and dV of 16 x d rows per warp leave no room.
__device__ __forceinline__ int block_head() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ int block_batch() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r));
    return r;
}
__device__ __forceinline__ int thread_index() {
    int r;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
    return r;
}

template <int kN>
__device__ __forceinline__ void zero_frags(float (&c)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}

// ---------------------------------------------------------------------------------------------------
// Forward.

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool Is_causal>
__global__ void __launch_bounds__(kNWarps * 32)
fa1_fwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse,
               float* __restrict__ o_run, float* __restrict__ m_run, float* __restrict__ l_run,
               int seqlen_q, int seqlen_k, int heads_q, int group,
               i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
               i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh,
               float scale_log2, int causal_offset) {
    static_assert(kBlockM == 16, "each warp takes query tiles of one 16-row mma tile");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
    static_assert(kStages >= 1, "at least one query buffer per warp");
    constexpr int kThreads = kNWarps * 32;
    constexpr int kNT = kBlockN / 8;   // n8 tiles of a score row block
    constexpr int kDT = kHeadDim / 8;  // n8 tiles of an output row block
    constexpr int kQTile = kBlockM * kHeadDim;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + kBlockN * kHeadDim;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    u16* sQ = sV + kBlockN * kHeadDim + warp * kStages * kQTile;  // this warp's query buffers

    const int h = blockIdx.x, b = blockIdx.y, h_kv = h / group;
    const u16* qg = q + b * q_sb + h * q_sh;
    const u16* kg = k + b * k_sb + h_kv * k_sh;
    const u16* vg = v + b * v_sb + h_kv * v_sh;
    u16* og = o + b * o_sb + h * o_sh;
    const i64 row_stat = ((i64)b * heads_q + h) * seqlen_q;  // row 0 of this head in lse, m, l
    float* o_run_h = o_run + row_stat * kHeadDim;
    const int m_tiles = (seqlen_q + kBlockM - 1) / kBlockM;

    // Query tiles that see no key at all (causal, rows i < -causal_offset): O = 0, lse = -inf.
    if (Is_causal) {
        for (int mi = warp; mi < m_tiles; mi += kNWarps) {
            if (causal_key_block_end(min(mi * kBlockM + kBlockM, seqlen_q), causal_offset, seqlen_k) > 0) break;
            for (int r = 0; r < kBlockM; ++r) {
                const int row = mi * kBlockM + r;
                if (row >= seqlen_q) break;
                for (int c = lane; c < kHeadDim / 2; c += 32) *reinterpret_cast<u32*>(og + (i64)row * o_ss + 2 * c) = 0u;
                if (lane == 0) lse[row_stat + row] = -CUFLASH_INF;
            }
        }
    }

    const int n_end = num_blocks<kBlockN>(Is_causal ? causal_key_block_end(seqlen_q, causal_offset, seqlen_k) : seqlen_k);
    for (int j = 0; j < n_end; ++j) {
        const int n0 = j * kBlockN;
        __syncthreads();  // every warp is done with K_{j-1}, V_{j-1}
        load_tile_async<kBlockN, kHeadDim, kThreads>(sK, kg, k_ss, n0, seqlen_k, tid);
        load_tile_async<kBlockN, kHeadDim, kThreads>(sV, vg, v_ss, n0, seqlen_k, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // Query tiles that can see key tile j: rows i >= n0 - causal_offset. This warp's share of them
        // goes through its own ring of kStages query buffers.
        const int m_first = (Is_causal ? causal_query_block_start(n0, causal_offset) : 0) / kBlockM + warp;
#pragma unroll
        for (int st = 0; st < kStages - 1; ++st) {
            const int mi = m_first + st * kNWarps;
            if (mi < m_tiles) load_tile_async<kBlockM, kHeadDim, 32>(sQ + st * kQTile, qg, q_ss, mi * kBlockM, seqlen_q, lane);
            cp_async_commit();
        }
        int it = 0;
        for (int mi = m_first; mi < m_tiles; mi += kNWarps, ++it) {
            const int mn = mi + (kStages - 1) * kNWarps;
            if (mn < m_tiles) {
                load_tile_async<kBlockM, kHeadDim, 32>(sQ + ((it + kStages - 1) % kStages) * kQTile, qg, q_ss,
                                                       mn * kBlockM, seqlen_q, lane);
            }
            cp_async_commit();
            const int m0 = mi * kBlockM;
            const bool first = j == 0;
            const int q_stop = min(m0 + kBlockM, seqlen_q);
            const int n_seen = num_blocks<kBlockN>(Is_causal ? causal_key_block_end(q_stop, causal_offset, seqlen_k) : seqlen_k);
            const bool last = j == n_seen - 1;  // the last key tile this query tile sees

            // [fa1-fwd 1] load O_i, m_i, l_i from HBM (not on the first key tile: O = 0, m = -inf, l = 0).
            // The running O is normalized; acc holds l * O, which step 3 rescales like FA2's accumulator.
            // l is kept lane-partial by OnlineSoftmax, so the carried sum goes to one lane of the quad.
            float acc[kDT][4];
            OnlineSoftmax sm;
            sm.init();
            zero_frags<kDT>(acc);
            if (!first) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = m0 + g + 8 * hh;
                    if (row < seqlen_q) {
                        const float l_old = l_run[row_stat + row];
                        sm.m[hh] = m_run[row_stat + row];
                        sm.l[hh] = t == 0 ? l_old : 0.f;
                        const float* src = o_run_h + (i64)row * kHeadDim + 2 * t;
#pragma unroll
                        for (int dt = 0; dt < kDT; ++dt) {
                            const float2 x = *reinterpret_cast<const float2*>(src + dt * 8);
                            acc[dt][2 * hh] = x.x * l_old;
                            acc[dt][2 * hh + 1] = x.y * l_old;
                        }
                    }
                }
            }
            cp_async_wait<kStages - 1>();  // Q_i has landed (this lane's copies) ...
            __syncwarp();                  // ... and every lane's
            const u16* tQ = sQ + (it % kStages) * kQTile;

            // [fa1-fwd 2] S = scale * Q K^T (times log2(e), for exp2), masked.
            float s[kNT][4];
            zero_frags<kNT>(s);
            warp_mma_abt<T, kHeadDim, kNT>(s, tQ, 0, sK, 0, lane);
            scale_scores<kNT>(s, scale_log2);
            const bool need_mask = n0 + kBlockN > seqlen_k || (Is_causal && n0 + kBlockN - 1 > m0 + causal_offset);
            if (need_mask) mask_scores<kNT, Is_causal>(s, m0, n0, seqlen_k, causal_offset, lane, -CUFLASH_INF);
            // [fa1-fwd 3] new row max, rescale l * O_old and l by exp(m_old - m_new);
            // [fa1-fwd 4] P = exp(S - m_new), l_new = alpha l_old + rowsum(P).
            sm.update(s, acc);
            // [fa1-fwd 5] l_new O_new = alpha l_old O_old + P V, P rounded to the input dtype.
            warp_mma_pb<T, kHeadDim, kNT, kDT>(acc, s, sV, lane);
            __syncwarp();  // every lane is done with tQ before the ring refills it

            // [fa1-fwd 6] normalize by l_new; write O, m, l back to HBM, or on the last key tile this
            // query tile sees, O in the output dtype and lse = m + log l (-inf for rows that saw no key).
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = m0 + g + 8 * hh;
                const float l = quad_sum(sm.l[hh]);
                const float inv = l > 0.f ? 1.f / l : 0.f;
                if (row >= seqlen_q) continue;
                if (last) {
                    u16* orow = og + (i64)row * o_ss + 2 * t;
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        *reinterpret_cast<u32*>(orow + dt * 8) = Elem<T>::pack(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
                    }
                    if (t == 0) lse[row_stat + row] = l > 0.f ? (sm.m[hh] + __log2f(l)) * kLn2 : -CUFLASH_INF;
                } else {
                    float* dst = o_run_h + (i64)row * kHeadDim + 2 * t;
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
                    }
                    if (t == 0) {
                        m_run[row_stat + row] = sm.m[hh];
                        l_run[row_stat + row] = l;
                    }
                }
            }
        }
        cp_async_wait<0>();
    }
}

// ---------------------------------------------------------------------------------------------------
// Backward.

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool Is_causal>
__global__ void __launch_bounds__(kNWarps * 32)
fa1_bwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
               float* __restrict__ dq_accum, u16* __restrict__ dk, u16* __restrict__ dv,
               float* __restrict__ dkv_accum,
               int seqlen_q, int seqlen_k, int heads_q, int group,
               i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
               i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh,
               i64 dk_sb, i64 dk_ss, i64 dk_sh, i64 dv_sb, i64 dv_ss, i64 dv_sh,
               float scale, int causal_offset) {
    static_assert(kBlockN == 16 * kNWarps, "each warp owns 16 key rows");
    static_assert(kBlockM % 32 == 0 && kHeadDim % 32 == 0, "tile shape");
    constexpr int kThreads = kNWarps * 32;
    constexpr int kMT8 = kBlockM / 8;   // n8 tiles of an S^T row block (query columns)
    constexpr int kDT = kHeadDim / 8;   // n8 tiles of dK, dV
    constexpr int kQTile = kBlockM * kHeadDim;
    // dQ step: the kBlockM x d tile of dS K is split over warps: kMT row tiles of 16, kCS column slices.
    constexpr int kMT = kBlockM / 16;
    constexpr int kCS = kNWarps / kMT > 0 ? kNWarps / kMT : 1;
    constexpr int kDW = kHeadDim / kCS;
    static_assert(kNWarps % kMT == 0 && kDW % 16 == 0, "dQ step warp split");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + kBlockN * kHeadDim;
    u16* sQ = sV + kBlockN * kHeadDim;
    u16* sdO = sQ + kStages * kQTile;
    float* sLse = reinterpret_cast<float*>(sdO + kStages * kQTile);  // kStages x kBlockM
    float* sD = sLse + kStages * kBlockM;                              // kStages x kBlockM
    u16* sdS = reinterpret_cast<u16*>(sD + kStages * kBlockM);         // dS^T, kBlockN x kBlockM

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const float scale_log2 = scale * kLog2e;
    const int m_tiles = (seqlen_q + kBlockM - 1) / kBlockM;
    const int n_tiles = (seqlen_k + kBlockN - 1) / kBlockN;

    // One query tile: Q, dO, and its rows' lse and D (rows past seqlen_q read as zeros: with dO = 0 and
    // D = 0 they add nothing to dV, dK or dQ whatever P is). Base pointers are recomputed here rather
    // than held across the loops: registers are tight with dK and dV of 16 x d rows per thread group.
    auto load_q_stage = [&](int stage, int mi) {
        const int h = block_head(), b = block_batch(), tid = thread_index();
        const u16* qg = q + b * q_sb + h * q_sh;
        const u16* dog = dout + b * do_sb + h * do_sh;
        const float* lse_row = lse + ((i64)b * heads_q + h) * seqlen_q;
        const float* delta_row = delta + ((i64)b * heads_q + h) * seqlen_q;
        load_tile_async<kBlockM, kHeadDim, kThreads>(sQ + stage * kQTile, qg, q_ss, mi * kBlockM, seqlen_q, tid);
        load_tile_async<kBlockM, kHeadDim, kThreads>(sdO + stage * kQTile, dog, do_ss, mi * kBlockM, seqlen_q, tid);
        load_row_stats_async<kBlockM, kThreads>(sLse + stage * kBlockM, sD + stage * kBlockM, lse_row, delta_row,
                                                mi * kBlockM, seqlen_q, tid);
    };

    // Every key tile, also those no query sees (their dK, dV are zeros).
#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * kBlockN;
        const int key_base = n0 + warp * 16;
        __syncthreads();  // every warp is done with K_{j-1}, V_{j-1} and the query ring
        {
            const int b = block_batch(), h_kv = block_head() / group, tid = thread_index();
            load_tile_async<kBlockN, kHeadDim, kThreads>(sK, k + b * k_sb + h_kv * k_sh, k_ss, n0, seqlen_k, tid);
            load_tile_async<kBlockN, kHeadDim, kThreads>(sV, v + b * v_sb + h_kv * v_sh, v_ss, n0, seqlen_k, tid);
        }
        cp_async_commit();
        // Query tiles that see key tile j: rows i >= n0 - causal_offset.
        const int m_begin = Is_causal ? causal_query_block_start(n0, causal_offset) / kBlockM : 0;
#pragma unroll
        for (int st = 0; st < kStages - 1; ++st) {
            if (m_begin + st < m_tiles) load_q_stage(st, m_begin + st);
            cp_async_commit();
        }

        float dk_acc[kDT][4], dv_acc[kDT][4];
        zero_frags<kDT>(dk_acc);
        zero_frags<kDT>(dv_acc);
#pragma unroll 1
        for (int mi = m_begin; mi < m_tiles; ++mi) {
            const int it = mi - m_begin;
            if (mi + kStages - 1 < m_tiles) load_q_stage((it + kStages - 1) % kStages, mi + kStages - 1);
            cp_async_commit();
            const u16* tQ = sQ + (it % kStages) * kQTile;
            const u16* tdO = sdO + (it % kStages) * kQTile;
            const float* tLse = sLse + (it % kStages) * kBlockM;
            const float* tD = sD + (it % kStages) * kBlockM;
            const int m0 = mi * kBlockM;
            cp_async_wait<kStages - 1>();
            __syncthreads();

            // [bwd 1] P^T = exp(scale K Q^T - lse): rows = this warp's 16 keys, cols = the kBlockM queries.
            // A row that saw no key has lse = -inf and P = +inf here, but every tile it meets crosses its
            // diagonal, so the mask below zeroes it.
            float st[kMT8][4];
            zero_frags<kMT8>(st);
            warp_mma_abt<T, kHeadDim, kMT8>(st, sK, warp * 16, tQ, 0, lane);
#pragma unroll
            for (int nt = 0; nt < kMT8; ++nt) {
                const float2 l2 = *reinterpret_cast<const float2*>(tLse + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) st[nt][e] = fast_exp2(fmaf(st[nt][e], scale_log2, -(e & 1 ? l2.y : l2.x) * kLog2e));
            }
            const bool need_mask = n0 + kBlockN > seqlen_k || (Is_causal && n0 + kBlockN - 1 > m0 + causal_offset);
            if (need_mask) mask_scores_t<kMT8, Is_causal>(st, key_base, m0, seqlen_k, causal_offset, lane, 0.f);

            // [bwd 2] dV_j += P^T dO_i.
            warp_mma_pb<T, kHeadDim, kMT8, kDT>(dv_acc, st, tdO, lane);
            // [bwd 3] dP^T = V dO^T.
            float dpt[kMT8][4];
            zero_frags<kMT8>(dpt);
            warp_mma_abt<T, kHeadDim, kMT8>(dpt, sV, warp * 16, tdO, 0, lane);
            // [bwd 4] dS^T = P^T (dP^T - D), in place of dP^T.
#pragma unroll
            for (int nt = 0; nt < kMT8; ++nt) {
                const float2 d2 = *reinterpret_cast<const float2*>(tD + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) dpt[nt][e] = st[nt][e] * (dpt[nt][e] - (e & 1 ? d2.y : d2.x));
            }
            // [bwd 6] dK_j += dS^T Q_i (scale applied when dK_j is written); dS^T also goes to shared
            // memory for the dQ step.
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk) {
                u32 a[4];
                c_to_a<T, kMT8>(a, dpt, kk);
                const int r = warp * 16 + g;  // dS^T rows r, r + 8; query cols 16 kk + 2 t (+1), + 8
                *reinterpret_cast<u32*>(sdS + Swizzle<kBlockM>::offset(r, 2 * kk) + 2 * t) = a[0];
                *reinterpret_cast<u32*>(sdS + Swizzle<kBlockM>::offset(r + 8, 2 * kk) + 2 * t) = a[1];
                *reinterpret_cast<u32*>(sdS + Swizzle<kBlockM>::offset(r, 2 * kk + 1) + 2 * t) = a[2];
                *reinterpret_cast<u32*>(sdS + Swizzle<kBlockM>::offset(r + 8, 2 * kk + 1) + 2 * t) = a[3];
                warp_mma_a_kn<T, kHeadDim, kDT>(dk_acc, a, tQ, kk * 16, lane);
            }
            __syncthreads();  // dS^T complete

            // [bwd 5] dQ_i += dS K_j, read-modify-written in the float32 workspace in HBM (scale applied
            // once, by the convert kernel). This warp owns query rows rt*16 .. +15, columns cs*kDW ..
            // +kDW-1; each element has one owning thread in every step, so no atomics are needed.
            const int rt = warp % kMT, cs = warp / kMT;
            float dq[kDW / 8][4];
            zero_frags<kDW / 8>(dq);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                u32 a[4];
                load_a_trans<kBlockM>(a, sdS, kk * 16, rt * 16, lane);
#pragma unroll
                for (int np = 0; np < kDW / 16; ++np) {
                    u32 bf[4];
                    load_b_kn<kHeadDim>(bf, sK, kk * 16, cs * (kDW / 16) + np, lane);
                    Elem<T>::mma(dq[2 * np], a, bf[0], bf[1]);
                    Elem<T>::mma(dq[2 * np + 1], a, bf[2], bf[3]);
                }
            }
            const int tv = thread_index(), row0 = m0 + ((tv >> 5) % kMT) * 16 + ((tv & 31) >> 2);
            float* dqg = dq_accum + (((i64)block_batch() * heads_q + block_head()) * seqlen_q + row0) * kHeadDim +
                         ((tv >> 5) / kMT) * kDW + 2 * (tv & 3);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                if (row0 + 8 * hh < seqlen_q) {
#pragma unroll
                    for (int dt = 0; dt < kDW / 8; ++dt) {
                        float2* p = reinterpret_cast<float2*>(dqg + hh * 8 * kHeadDim + dt * 8);
                        const float2 x = *p;
                        *p = make_float2(x.x + dq[dt][2 * hh], x.y + dq[dt][2 * hh + 1]);
                    }
                }
            }
            __syncthreads();  // this query tile's buffers and dS^T are free for the next refill
        }
        cp_async_wait<0>();

        // Write dK_j = scale * dK_acc and dV_j: straight to dk/dv (group == 1) or per query head to the
        // float32 workspace that flash_bwd_reduce_dkv_kernel sums over the group.
        {
        const int h = block_head(), b = block_batch();
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = key_base + g + 8 * hh;
            if (row >= seqlen_k) continue;
            if (group == 1) {
                u16* dkr = dk + b * dk_sb + h * dk_sh + (i64)row * dk_ss + 2 * t;
                u16* dvr = dv + b * dv_sb + h * dv_sh + (i64)row * dv_ss + 2 * t;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    *reinterpret_cast<u32*>(dkr + dt * 8) = Elem<T>::pack(dk_acc[dt][2 * hh] * scale, dk_acc[dt][2 * hh + 1] * scale);
                    *reinterpret_cast<u32*>(dvr + dt * 8) = Elem<T>::pack(dv_acc[dt][2 * hh], dv_acc[dt][2 * hh + 1]);
                }
            } else {
                const i64 plane = (i64)gridDim.y * heads_q * seqlen_k * kHeadDim;
                float* dkr = dkv_accum + (((i64)b * heads_q + h) * seqlen_k + row) * kHeadDim + 2 * t;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    *reinterpret_cast<float2*>(dkr + dt * 8) = make_float2(dk_acc[dt][2 * hh] * scale, dk_acc[dt][2 * hh + 1] * scale);
                    *reinterpret_cast<float2*>(dkr + plane + dt * 8) = make_float2(dv_acc[dt][2 * hh], dv_acc[dt][2 * hh + 1]);
                }
            }
        }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// float32 inputs: the same FA1 loop order, grid and global-memory running state on plain float32
// arithmetic (no tensor cores; as accurate as float32 allows). Four warps per block; where the 16-bit
// kernels give a warp a 16-row mma tile, these give it one row.

// Forward: key/value tiles of kBlockN <= 32 rows outer (K_j, V_j in shared memory, load_kv_f32); each warp
// takes the query rows that see the tile in turn (first + warp, first + warp + 4, ...). Per row,
// [fa1-fwd 1] reads O_i (float32, normalized), m_i, l_i back from global memory (not on the first key
// tile), [fa1-fwd 2..5] is f32_row_step (f32_tiles.cuh, shared with FA2's float32 forward), and
// [fa1-fwd 6] writes O_i, m_i, l_i back, or on the last key tile the row sees, O in the output and
// lse = m + log l.
template <int kHeadDim, int kBlockN, bool Is_causal>
__global__ void __launch_bounds__(128, 1)
fa1_fwd_f32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   float* __restrict__ o, float* __restrict__ lse,
                   float* __restrict__ o_run, float* __restrict__ m_run, float* __restrict__ l_run,
                   int seqlen_q, int seqlen_k, int heads_q, int group,
                   i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                   i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh,
                   float scale_log2, int causal_offset) {
    static_assert(kHeadDim % 32 == 0 && kBlockN >= 1 && kBlockN <= 32, "one lane per key of the tile");
    constexpr int kNWarps = 4, kThreads = 32 * kNWarps, kPer = kHeadDim / 32, kKStride = kHeadDim + 1;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* sK = reinterpret_cast<float*>(smem_raw);  // kBlockN x kKStride
    float* sV = sK + kBlockN * kKStride;               // kBlockN x kHeadDim
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* sq = sV + kBlockN * kHeadDim + warp * kHeadDim;  // this warp's query row

    const int h = blockIdx.x, b = blockIdx.y, h_kv = h / group;
    const float* qg = q + b * q_sb + h * q_sh;
    const float* kg = k + b * k_sb + h_kv * k_sh;
    const float* vg = v + b * v_sb + h_kv * v_sh;
    float* og = o + b * o_sb + h * o_sh;
    const i64 row_stat = ((i64)b * heads_q + h) * seqlen_q;
    float* o_run_h = o_run + row_stat * kHeadDim;

    // Rows that see no key at all (causal, i < -causal_offset): O = 0, lse = -inf.
    if (Is_causal) {
        for (int row = warp; row < min(seqlen_q, causal_query_block_start(0, causal_offset)); row += kNWarps) {
#pragma unroll
            for (int c = 0; c < kPer; ++c) og[(i64)row * o_ss + lane + 32 * c] = 0.f;
            if (lane == 0) lse[row_stat + row] = -CUFLASH_INF;
        }
    }

    const int n_end = num_blocks<kBlockN>(Is_causal ? causal_key_block_end(seqlen_q, causal_offset, seqlen_k) : seqlen_k);
    for (int j = 0; j < n_end; ++j) {
        const int n0 = j * kBlockN;
        __syncthreads();  // every warp is done with K_{j-1}, V_{j-1}
        load_kv_f32<kBlockN, kHeadDim, kKStride, kThreads>(sK, sV, kg, k_ss, vg, v_ss, n0, seqlen_k, tid);
        __syncthreads();

        // Rows that see key tile j: i >= n0 - causal_offset (each of them sees key n0, so its max is finite).
        const int r_begin = Is_causal ? causal_query_block_start(n0, causal_offset) : 0;
        for (int row = r_begin + warp; row < seqlen_q; row += kNWarps) {
            const int n_keys = Is_causal ? causal_key_block_end(row + 1, causal_offset, seqlen_k) : seqlen_k;
            const bool first = j == 0, last = j == num_blocks<kBlockN>(n_keys) - 1;
            // [fa1-fwd 1] Q_i to shared memory; O_i, m_i, l_i from HBM (acc holds l * O, as in fa1_fwd_kernel).
            const float* qrow = qg + (i64)row * q_ss;
#pragma unroll
            for (int c = 0; c < kPer; ++c) sq[lane + 32 * c] = qrow[lane + 32 * c];
            float acc[kPer], m = -CUFLASH_INF, l = 0.f;
            if (first) {
#pragma unroll
                for (int c = 0; c < kPer; ++c) acc[c] = 0.f;
            } else {
                m = m_run[row_stat + row];
                l = l_run[row_stat + row];
                const float* src = o_run_h + (i64)row * kHeadDim;
#pragma unroll
                for (int c = 0; c < kPer; ++c) acc[c] = src[lane + 32 * c] * l;
            }
            __syncwarp();
            // [fa1-fwd 2..5] scores, online-softmax update, l_new O_new = corr l_old O_old + P V_j.
            f32_row_step<kHeadDim, kBlockN>(sq, sK, sV, n0, 0, n_keys, scale_log2, acc, m, l, lane,
                                            [](float s, int) { return s; });
            // [fa1-fwd 6] normalize; O_i, m_i, l_i back to HBM, or the output and lse on the last tile.
            const float inv = 1.f / l;
            if (last) {
                float* orow = og + (i64)row * o_ss;
#pragma unroll
                for (int c = 0; c < kPer; ++c) orow[lane + 32 * c] = acc[c] * inv;
                if (lane == 0) lse[row_stat + row] = m * kLn2 + logf(l);
            } else {
                float* dst = o_run_h + (i64)row * kHeadDim;
#pragma unroll
                for (int c = 0; c < kPer; ++c) dst[lane + 32 * c] = acc[c] * inv;
                if (lane == 0) {
                    m_run[row_stat + row] = m;
                    l_run[row_stat + row] = l;
                }
            }
            __syncwarp();  // every lane is done with sq before the next row overwrites it
        }
    }
}

// Backward: every key/value tile in turn (bwd_f32_key_tile, f32_tiles.cuh: query rows inner, one at a
// time for the whole block), dQ_i read-modify-written in dq (float32, zeroed by the launcher) at every
// step: the block owns its (batch, head), so no atomics. dK = scale dK_acc and dV go per query head to the
// float32 workspace dkv (2, B, heads_q, seqlen_k, d); the launcher sums each GQA group.
template <int kHeadDim, int kBlockN, bool Is_causal>
__global__ void __launch_bounds__(128, 1)
fa1_bwd_f32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                   float* __restrict__ dq, float* __restrict__ dkv,
                   int seqlen_q, int seqlen_k, int heads_q, int group,
                   i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                   i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh,
                   i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale, int causal_offset) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const F32BwdArgs args{q, k, v, dout, lse, delta, dq, dkv, seqlen_q, seqlen_k, heads_q, group, (int)gridDim.y,
                          q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh,
                          dq_sb, dq_ss, dq_sh, scale};
    const BlockInfo<CausalVariant<Is_causal>> bi(blockIdx.y, seqlen_q, seqlen_k, causal_offset);
    // Every key tile, also those no query sees (their dK, dV are zeros).
    for (int j = 0; j < num_blocks<kBlockN>(seqlen_k); ++j) {
        bwd_f32_key_tile<kHeadDim, kBlockN, CausalVariant<Is_causal>, DqUpdate::kReadModifyWrite>(
            args, bi, j, blockIdx.x, blockIdx.y, reinterpret_cast<float*>(smem_raw));
    }
}

}  // namespace cuflash
