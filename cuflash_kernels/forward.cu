// cuflash forward kernels (FlashAttention-2 order), mirroring cuflash/reference.py:fa2_forward.
//
// Algorithm (flash_fwd_kernel, float16/bfloat16): one thread block owns one query tile of kBlockM rows of
// one (batch, query head). Each of its kNWarps warps owns kBlockM / kNWarps query rows (1 or 2 mma tiles
// of 16; with 2, every K/V fragment read from shared memory feeds two mma, halving shared-memory traffic). The block streams the key/value
// tiles of kBlockN rows through a ring of kStages shared-memory buffers with cp.async (K and V are
// separate commit groups, so V of tile j still loads while S = Q K_j^T is computed); per tile it forms
// the scores in float32 registers with mma.sync, updates the running row max / sum (online softmax, exp2
// with log2(e) folded into the scale), keeps P in registers as the A operand of P @ V, and normalizes
// the output once at the end. lse (natural log) is written per row.
// Causal masking skips key tiles wholly above the diagonal; only tiles that cross the diagonal or the
// end of the key sequence are masked element by element.
//
// Grid: (ceil(seqlen_q / kBlockM), heads_q, batch); query tiles are taken last-first so the longest
// causal tiles start first. Key/value head = query head / group (GQA/MQA without expanding K, V).
//
// Shared memory (16-bit elements): Q kBlockM x d + kStages x (K + V) kBlockN x d, swizzled;
// bytes = 2 * d * (kBlockM + 2 * kStages * kBlockN), e.g. d = 128, 128 x 64, 2 stages: 96 KiB.
//
// flash_fwd_f32_kernel: the float32 path, plain SIMT float32 arithmetic (no tensor cores): query tiles of
// 4 * kRows rows, key/value tiles through shared memory, one warp per query row at a time, lanes over keys
// for the scores and over the head dimension for the output (f32_row_step, shared with fa1.cu).
#include "cuflash_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"
#include "f32_tiles.cuh"
#include "tf32_tiles.cuh"

namespace cuflash {

// What the element type T changes in flash_fwd_kernel: the storage, the tile copies, the two matrix products and
// the output store (everything between them, scores, variants and online softmax, is T's C fragments in float32).
// float16 / bfloat16: mma.sync m16n8k16 on ldmatrix fragments (cuflash_tiles.cuh), written inline in the kernel
// (kTf32 false): as member functions NVVM placed a few address computations differently (same registers, not the
// same PTX); inline, the 16-bit PTX is the PTX from before FwdMma. tf32 / tf32x3: Tf32FwdMma's qk, pv, store_row.
template <class T>
struct FwdMma {
    using Storage = u16;
    static constexpr int kHeadDimStep = 16;    // head dims the tiles take
    static constexpr bool kExactMods = false;  // softcap with tanh_exp2 (~3e-7 absolute: the 16-bit budget)
    static constexpr bool kTf32 = false;       // the products and the store: inline in the kernel

    template <int kRows, int kW, int kThreads, int kCols, bool kIsV>
    __device__ __forceinline__ static void load(u16* tile, const u16* g, i64 stride, int row0, int nrows, int tid, int cols8) {
        load_tile_async<kRows, kW, kThreads, kCols>(tile, g, stride, row0, nrows, tid, cols8);
    }
};
template <> struct FwdMma<tf32> : Tf32FwdMma<1> {};
template <> struct FwdMma<tf32x3> : Tf32FwdMma<3> {};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__device__ __forceinline__ void flash_fwd(CUFLASH_FWD_PARAMS(typename FwdMma<T>::Storage), const VariantParams vp) {
    using Mma = FwdMma<T>;
    using E = typename Mma::Storage;
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns kMT x 16 query rows");
    static_assert(kBlockN % 16 == 0 && kHeadDim % Mma::kHeadDimStep == 0, "tile shape");
    static_assert(kStages >= 1, "at least one key/value buffer");
    static_assert(!V::Bias::kStaged, "reads the bias from global memory (the wgmma kernels stage it)");
    constexpr int kThreads = kNWarps * 32;
    constexpr int kMT = kBlockM / (16 * kNWarps);  // 16-row mma tiles per warp: B fragments read once, used kMT times
    constexpr int kNT = kBlockN / 8;     // n8 tiles of a score row block
    constexpr int kDT = kHeadDim / 8;    // n8 tiles of an output row block
    // [variant head dim] Shared-memory rows are kW wide (the swizzle's multiple of 32); a head dim of 16 * odd has
    // a tail of 16 columns that is never loaded nor read.
    constexpr int kW = (kHeadDim + 31) / 32 * 32;
    constexpr int kTile = kBlockN * kW;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    E* sQ = reinterpret_cast<E*>(smem_raw);
    E* sK = sQ + kBlockM * kW;
    E* sV = sK + kStages * kTile;

    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = m_block * kBlockM;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if (bi.past_queries(m0)) return;  // a shorter sequence of a packed batch

    // The n_end key tiles from tile n_begin hold the keys this query tile sees (causal, window). The K/V
    // pointers start at tile n_begin, so the loop below counts tiles from there: key = n_shift + local.
    const TileLoop<V> keys = bi.template key_loop<kBlockN, kBlockM>(m_block);  // [variant mask] a block map's list
    const int n_begin = keys.first, n_end = keys.count;
    const auto tile_row = [&](int j) { return (keys.tile(j) - n_begin) * kBlockN; };  // from tile n_begin on
    const int n_shift = n_begin * kBlockN;
    const int len_k = bi.len_k - n_shift;  // keys left from the first tile on

    const E* qg = bi.q_rows(q, b, h, q_sb, q_sh, q_ss);
    const int qk8 = bi.template qk_cols8<kHeadDim>(), v8 = bi.template v_cols8<kHeadDim>();  // [variant head dim]
    const E* kg = bi.k_rows(k, b, h_kv, k_sb, k_sh, k_ss) + (i64)n_shift * k_ss;
    const E* vg = bi.k_rows(v, b, h_kv, v_sb, v_sh, v_ss) + (i64)n_shift * v_ss;

    // [fa2-fwd 1] load the query block (its own commit group), then the first kStages - 1 K/V tiles.
    Mma::template load<kBlockM, kW, kThreads, kHeadDim, false>(sQ, qg, q_ss, m0, bi.len_q, tid, qk8);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_end) Mma::template load<kBlockN, kW, kThreads, kHeadDim, false>(sK + st * kTile, kg, k_ss, tile_row(st), len_k, tid, qk8);
        cp_async_commit();
        if (st < n_end) Mma::template load<kBlockN, kW, kThreads, kHeadDim, true>(sV + st * kTile, vg, v_ss, tile_row(st), len_k, tid, v8);
        cp_async_commit();
    }

    float acc[kMT][kDT][4];
    OnlineSoftmax sm[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
        sm[mt].init();
    }
    const int row_base = m0 + warp * 16 * kMT;

    for (int j = 0; j < n_end; ++j) {
        // Refill the buffer freed at the end of iteration j - 1 with tile j + kStages - 1.
        const int jn = j + kStages - 1;
        const int buf_n = jn % kStages;
        if (jn < n_end) Mma::template load<kBlockN, kW, kThreads, kHeadDim, false>(sK + buf_n * kTile, kg, k_ss, tile_row(jn), len_k, tid, qk8);
        cp_async_commit();
        if (jn < n_end) Mma::template load<kBlockN, kW, kThreads, kHeadDim, true>(sV + buf_n * kTile, vg, v_ss, tile_row(jn), len_k, tid, v8);
        cp_async_commit();
        const E* tK = sK + (j % kStages) * kTile;
        const E* tV = sV + (j % kStages) * kTile;

        cp_async_wait<2 * kStages - 1>();  // Q and K_j have landed; V_j may still be in flight
        __syncthreads();

        // [fa2-fwd 2] S = scale * Q K^T (times log2(e), for exp2), masked.
        float s[kMT][kNT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
        }
        if constexpr (Mma::kTf32) {
            Mma::template qk<kMT, kNT, kHeadDim, kW>(s, sQ, tK, warp * kMT * 16, lane);
        } else {  // (16-bit: m16n8k16 inline, as this kernel had it before FwdMma; the PTX stays what it was)
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                u32 a[kMT][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) load_a<kW>(a[mt], sQ, (warp * kMT + mt) * 16, kk, lane);
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) {
                    u32 bf[4];
                    load_b_nk<kW>(bf, tK, np * 16, kk, lane);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        Elem<T>::mma(s[mt][2 * np], a[mt], bf[0], bf[1]);
                        Elem<T>::mma(s[mt][2 * np + 1], a[mt], bf[2], bf[3]);
                    }
                }
            }
        }
        const int n0 = n_shift + tile_row(j);  // the tile's first key in the sequence
        // (kExactMods: mod_scores applies mask_mod on a partial tile already, with the float32 math)
        const bool mask_mod = !Mma::kExactMods && keys.mask_mod_in_mask(j);
        const bool need_mask = bi.needs_mask(m0, kBlockM, n0, kBlockN) || mask_mod;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            mod_scores<false, Mma::kExactMods>(s[mt], bi, row_base + mt * 16, n0, lane, keys.partial(j));  // [variant mod]
            scale_scores<kNT>(s[mt], scale_log2);
            if (need_mask) mask_block<false>(s[mt], bi, row_base + mt * 16, n0, lane, -CUFLASH_INF, mask_mod);  // [variant mask]
            // [fa2-fwd 3] and [fa2-fwd 4]
            sm[mt].update(s[mt], acc[mt]);
            dropout_scores<false>(s[mt], bi, row_base + mt * 16, n0, lane, 1.f);  // [variant dropout] after the row sum
        }

        cp_async_wait<2 * kStages - 2>();  // V_j has landed
        __syncthreads();

        // [fa2-fwd 5] acc += P V
        if constexpr (Mma::kTf32) {
            Mma::template pv<kMT, kNT, kDT, kW>(acc, s, tV, lane);
        } else {  // P cast to the input dtype and used straight from registers
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                u32 a[kMT][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) c_to_a<T, kNT>(a[mt], s[mt], kk);
#pragma unroll
                for (int np = 0; np < kDT / 2; ++np) {
                    u32 bf[4];
                    load_b_kn<kW>(bf, tV, kk * 16, np, lane);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        Elem<T>::mma(acc[mt][2 * np], a[mt], bf[0], bf[1]);
                        Elem<T>::mma(acc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer j % kStages before it is refilled
    }
    cp_async_wait<0>();

    // [fa2-fwd 6] O = acc / l, lse = m + log l; rows that saw no key: O = 0, lse = -inf.
    const int g = lane >> 2, t = lane & 3;
    E* og = o + b * o_sb + h * o_sh + (i64)bi.q0 * o_ss;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float l = quad_sum(sm[mt].l[hh]);
            const float inv = bi.out_scale(V::Has_dropout ? bi.keep_scale : 1.f, l);  // [variant dropout] 1 / (1 - p)
            const int row = row_base + mt * 16 + g + 8 * hh;
            if (row < bi.len_q) {
                E* orow = og + (i64)row * o_ss;
                if constexpr (Mma::kTf32) {
                    Mma::template store_row<V::Pads_head_dim, kDT>(orow, acc[mt], hh, inv, t, v8);
                } else {
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        if (V::Pads_head_dim && dt >= v8) break;  // [variant head dim] the output's columns only
                        *reinterpret_cast<u32*>(orow + dt * 8 + 2 * t) =
                            Elem<T>::pack(acc[mt][dt][2 * hh] * inv, acc[mt][dt][2 * hh + 1] * inv);
                    }
                }
                if (t == 0) {
                    lse[bi.row_index(h, heads_q, seqlen_q, row)] = bi.row_lse((sm[mt].m[hh] + __log2f(l)) * kLn2, l);
                }
            }
        }
    }
}

// flash_fwd's entry points: the launcher's (VariantParams by value) and the flat one (CUFLASH_VARIANT_FLAT_PARAMS)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32)
flash_fwd_kernel(CUFLASH_FWD_PARAMS(typename FwdMma<T>::Storage), const VariantParams vp) {
    flash_fwd<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_FWD_ARGS, vp);
}
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32)
flash_fwd_flat_kernel(CUFLASH_FWD_PARAMS(typename FwdMma<T>::Storage), CUFLASH_VARIANT_FLAT_PARAMS) {
    flash_fwd<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_FWD_ARGS, CUFLASH_VARIANT_FLAT_ARGS);
}

// float32 forward: plain SIMT arithmetic. One thread block per query tile of kBlockM = 4 * kRows rows
// (kRows per warp); key/value tiles of kBlockN <= 32 rows through shared memory (load_kv_f32); each
// warp takes its rows one at a time against the tile (f32_row_step: lane j scores key n0 + j, lane c
// accumulates head-dim elements c, c + 32, ... of l * O), keeping every row's l * O, m, l in registers
// across the key loop; the output is normalized once and lse written per row.
template <int kHeadDim, int kBlockM, int kBlockN, class V>
__global__ void __launch_bounds__(128, 1)
flash_fwd_f32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     float* __restrict__ o, float* __restrict__ lse,
                     int seqlen_q, int seqlen_k, int heads_q, int group,
                     i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                     i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh,
                     float scale_log2, const VariantParams vp) {
    constexpr int kNWarps = 4, kThreads = 32 * kNWarps, kRows = kBlockM / kNWarps, kPer = kHeadDim / 32;
    constexpr int kKStride = kHeadDim + 1;
    static_assert(kBlockM % kNWarps == 0 && kHeadDim % 32 == 0, "tile shape");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* sK = reinterpret_cast<float*>(smem_raw);  // kBlockN x kKStride
    float* sV = sK + kBlockN * kKStride;               // kBlockN x kHeadDim
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* sQ = sV + kBlockN * kHeadDim + warp * kRows * kHeadDim;  // this warp's kRows query rows
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int m0 = blockIdx.x * kBlockM, row0 = m0 + warp * kRows;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if (bi.past_queries(m0)) return;  // a shorter sequence of a packed batch
    const float* qg = q + b * q_sb + h * q_sh + (i64)bi.q0 * q_ss;
    const float* kg = k + b * k_sb + h_kv * k_sh + (i64)bi.k0 * k_ss;
    const float* vg = v + b * v_sb + h_kv * v_sh + (i64)bi.k0 * v_ss;

    // [fa2-fwd 1] this warp's query rows (rows past the sequence as zeros, never used).
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
            sQ[i * kHeadDim + lane + 32 * c] = row0 + i < bi.len_q ? qg[(i64)(row0 + i) * q_ss + lane + 32 * c] : 0.f;
        }
    }
    float acc[kRows][kPer], m[kRows], l[kRows];
    int2 keys[kRows];  // keys [x, y) seen by each row
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        m[i] = -CUFLASH_INF;
        l[i] = 0.f;
        keys[i] = row0 + i >= bi.len_q ? make_int2(0, 0) : bi.key_range(row0 + i, row0 + i + 1);
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[i][c] = 0.f;
    }
    const int2 kr = bi.key_range(m0, min(m0 + kBlockM, bi.len_q));
    const auto mod = [&](int i) { return [&bi, i](float s, int key) { return bi.template mod<true>(s, i, key); }; };
    const auto drop = [&](int i) { return [&bi, i](float p, int key) { return !V::Has_dropout || bi.keep(i, key) ? p : 0.f; }; };
    for (int n0 = kr.x - kr.x % kBlockN; n0 < kr.y; n0 += kBlockN) {
        __syncthreads();  // every warp is done with the previous K, V tile (and, the first time, sQ is written)
        load_kv_f32<kBlockN, kHeadDim, kKStride, kThreads>(sK, sV, kg, k_ss, vg, v_ss, n0, bi.len_k, tid);
        __syncthreads();
        // [fa2-fwd 2..5] for the rows that see a key of the tile (causal, window: skip the others).
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            if (n0 < keys[i].y && n0 + kBlockN > keys[i].x) {
                f32_row_step<kHeadDim, kBlockN>(sQ + i * kHeadDim, sK, sV, n0, keys[i].x, keys[i].y, scale_log2, acc[i],
                                                m[i], l[i], lane, mod(row0 + i), drop(row0 + i));
            }
        }
    }
    // [fa2-fwd 6] O = acc / l; lse = m + log l (rows that saw no key: O = 0, lse = -inf).
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int row = row0 + i;
        if (row >= bi.len_q) continue;
        const float inv = bi.out_scale(V::Has_dropout ? bi.keep_scale : 1.f, l[i]);
        float* orow = o + b * o_sb + h * o_sh + (i64)(bi.q0 + row) * o_ss;
#pragma unroll
        for (int c = 0; c < kPer; ++c) orow[lane + 32 * c] = acc[i][c] * inv;
        if (lane == 0) lse[bi.row_index(h, heads_q, seqlen_q, row)] = bi.row_lse(m[i] * kLn2 + logf(l[i]), l[i]);
    }
}

}  // namespace cuflash
