// cuflash Hopper forward kernel (sm_90a, wgmma), FlashAttention-2 order, mirroring
// cuflash/reference.py:fa2_forward. Same contract as flash_fwd_kernel in forward.cu; the launcher picks
// this one on sm_90 devices for float16/bfloat16 at the head dims of the ("fwd", "sm90a", d) tile rows.
//
// Algorithm (flash_fwd_sm90_kernel): one thread block owns one query tile of kBlockM rows of one (batch,
// query head); each of its kBlockM / 64 computing warpgroups (128 threads) owns 64 query rows. Q, K and V
// live in shared memory in the 128-byte-swizzled layout that wgmma descriptors read (hopper_tiles.cuh);
// K and V stream through two buffers each, loaded one tile ahead: with cp.async by all threads, or by a
// producer warpgroup in the warp-specialized variant (see Sm90Config), whose copies are either cp.async by its
// 128 threads or, from the TMA entry point (flash_fwd_sm90_tma_kernel), tensor copies issued by one thread
// through the tensor maps of q, k and v (64-column boxes in the same swizzle, zeros past the sequence's end).
// Per key tile j, each warpgroup:
//   S_j = Q K_j^T           wgmma m64 n=kBlockN k16, both operands from shared memory (K-major)
//   O  += P_{j-1} V_{j-1}   wgmma m64 n=d k16, P from registers, V MN-major (transpose bit)
// are issued back to back; while the tensor cores run P V, the warpgroup does the online softmax of S_j
// (row max, exp2 with scale * log2(e) folded into one FMA, row sum), then waits for P V, rescales O and
// packs P_j to 16 bits in registers for the next iteration. O is normalized once at the end and stored
// through shared memory (the warpgroup's own rows of the Q buffer) with 16-byte coalesced stores.
// Causal: key tiles wholly above the diagonal are skipped; only tiles that cross it (or the end of K)
// are masked element by element. Rows that see no key: O = 0, lse = -inf.
//
// [variant bias tile] A staged bias (V::Bias::kStaged): the bias of score tile j (kBlockM x kBlockN, its own
// dtype) is copied with cp.async in the commit group of K_j, one tile ahead, into one of two buffers, and the mod
// of S_j reads it from there (16-bit: one ldmatrix per 16 keys) instead of every thread reading global memory.
//
// Grid: (ceil(seqlen_q / kBlockM), heads_q, batch), query tiles last-first (longest causal tiles start
// first); key/value head = query head / group. [fwd persistent] (the TMA entry point's kPersistent): as many blocks
// as the GPU holds, each taking tiles in that order from a counter (run_tiles), the K/V buffers' phases carried.
// Shared memory: 2 * d * (kBlockM + 4 * kBlockN) bytes + 1024 for alignment + 128 for mbarriers, e.g.
// d = 128, 128 x 128: 161 KiB; d = 64, 128 x 64: 49 KiB (two blocks per SM); a staged bias adds two tiles,
// 2 * kBlockM * kBlockN * sizeof(element) bytes (d = 128, 128 x 128, bf16: + 64 KiB = 225 KiB). The V^T entry point
// ([fp8], [tf32], [f16x2]'s K and V): Q's tile at max(2, element bytes) an element, stages x (K, V^T) at the
// element's bytes (e4m3 d 128, 128 x 128: 97 KiB; tf32 and f16x2 d 128, 128 x 64: 193 KiB).
#include "cuflash_tiles.cuh"
#include "hopper_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"

namespace cuflash {

// Named barrier over the 128 threads of one warpgroup (id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int wg) {
    asm volatile("bar.sync %0, 128;" :: "r"(wg + 1) : "memory");
}

// [fwd rescale skip] O's rescale by exp2(m_old - m_new) after each key tile is skipped by a warp whose rows' maxima
// all stayed (softmax_step then gives the factor as exactly 1, where the FMA's residual made it 1 + a few ulp), which
// past the first tiles of a long row is most tiles: one vote instead of d / 2 multiplies a thread (as many as the
// tile's exponentials at d 128). On in the FP8 kernels, where it measured +2-5 % (H200, 2026-11-28); off in the 16-bit
// ones (-5 % at d 64, +-3 % at d 128). -DCUFLASH_FWD_RESCALE_SKIP=0 / 1 (CUFLASH_DEFINES) sets it for every kernel.
#ifndef CUFLASH_FWD_RESCALE_SKIP
#define CUFLASH_FWD_RESCALE_SKIP -1
#endif
// [fp8 fold] (below) on; -DCUFLASH_FP8_FOLD_DESCALE=0 for the multiply per score.
#ifndef CUFLASH_FP8_FOLD_DESCALE
#define CUFLASH_FP8_FOLD_DESCALE 1
#endif

// [fp8 exp16] (an experiment, off: 0) The FP8 forward's P on the 16-bit path, two scores an instruction: the
// arguments (float32, as now) rounded to an fp16 pair, one ex2.approx.f16x2 (one MUFU operation for two exponentials),
// the row sums accumulated in fp16 pairs within a tile (widened to float32 once a tile), and P packed to e4m3 from
// the pairs (cvt e4m3x2.f16x2). Per two scores about 6.5 issue slots where the float32 path takes 7.5: the d 128 FP8
// kernel's pace is its issue slots' (kernel-notes: MUFU 42 % busy). Precision: an argument's fp16 rounding moves P by
// at most 2^-8 of itself where P >= 2^-8 of its row's maximum (e4m3 rounds P by 2^-4), and the tile's sums add about
// 2^-11 relative per addition (2^-7 |O| is the FP8 budget's). Arguments below -24 (P under 2^-24 of the maximum
// after [fp8 p]'s offset) flush to zero, which e4m3's smallest subnormal (2^-9) does anyway. Measured (H200
// 2026-11-29, tools/fp8_ab.py, d 128): 8-11 % slower than the float32 path in every cell (557-803 against 603-876
// TFLOP/s): kept off.
#ifndef CUFLASH_FP8_EXP16
#define CUFLASH_FP8_EXP16 0
#endif

// [fp8 exp16] exp2 of a (low half) and b (high half) as an fp16 pair.
__device__ __forceinline__ u32 exp2_f16x2(float a, float b) {
    u32 x, e;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(x) : "f"(b), "f"(a));
    asm("ex2.approx.f16x2 %0, %1;" : "=r"(e) : "r"(x));
    return e;
}
__device__ __forceinline__ u32 add_f16x2(u32 a, u32 b) {
    u32 d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ float sum_f16x2(u32 a) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(a));
    return lo + hi;
}
// ... and [fp8 p]'s A fragment from such pairs, ph[n][0] row g's and ph[n][1] row g + 8's of n8 tile n (p_to_e4m3's
// order: the low half is the pair's first key).
template <int kNT>
__device__ __forceinline__ void p_f16x2_to_e4m3(u32 (&a)[4], const u32 (&ph)[kNT][2], int kk) {
    auto pack = [](u32 p01, u32 p23) {
        unsigned short lo, hi;
        asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(lo) : "r"(p01));
        asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(hi) : "r"(p23));
        return (u32)lo | ((u32)hi << 16);
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = 4 * kk + 2 * h;
        a[2 * h] = pack(ph[n][0], ph[n + 1][0]);
        a[2 * h + 1] = pack(ph[n][1], ph[n + 1][1]);
    }
}

// [fa2-fwd 3] and [fa2-fwd 4] on raw (unscaled) scores: m is the running row max of the raw scores, l the
// lane-partial row sum; S is replaced by P = exp2(scale_log2 * (S - m_new)) and corr[h] =
// exp2(scale_log2 * (m_old - m_new)) is returned for the caller to rescale O once P V of the previous tile
// has retired. A row that has seen only masked keys keeps m = -inf and subtracts 0 instead (no NaN). [fp8 p] kPOff:
// P = exp2(scale_log2 * (S - m_new) + kPOff), at most 2^kPOff (l and O grow by the same factor, lse subtracts it), so
// that e4m3's 3-bit mantissa holds P's small values as normal numbers rather than subnormals or zeros. [fp8 exp16]
// kExp16: P as fp16 pairs in ph instead (ph[nt][h]: row h's two scores of n8 tile nt), s left as the raw scores.
template <int kNT, int kPOff = 0, bool kRescaleSkip = false, bool kExp16 = false>
__device__ __forceinline__ void softmax_step(u32 (&ph)[kExp16 ? kNT : 1][2], float (&s)[kNT][4], float (&m)[2],
                                             float (&l)[2], float (&corr)[2], float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = m[h];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
        mx = quad_max(mx);
        const float m_scaled = mx == -CUFLASH_INF ? 0.f : mx * scale_log2;
        // ([fwd rescale skip]: exactly 1 where the maximum stayed, which the FMA's residual would make 1 + a few ulp)
        corr[h] = kRescaleSkip && mx == m[h] ? 1.f : fast_exp2(fmaf(m[h], scale_log2, -m_scaled));
        m[h] = mx;
        float m_p = m_scaled;
        if constexpr (kPOff != 0) m_p -= float(kPOff);
        float sum = 0.f;
        if constexpr (kExp16) {  // [fp8 exp16] the pairs in ph (p_f16x2_to_e4m3 reads them there)
            u32 pairs = 0u;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                ph[nt][h] = exp2_f16x2(fmaf(s[nt][2 * h], scale_log2, -m_p), fmaf(s[nt][2 * h + 1], scale_log2, -m_p));
                pairs = add_f16x2(pairs, ph[nt][h]);
            }
            sum = sum_f16x2(pairs);
        } else {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                s[nt][2 * h] = fast_exp2(fmaf(s[nt][2 * h], scale_log2, -m_p));
                s[nt][2 * h + 1] = fast_exp2(fmaf(s[nt][2 * h + 1], scale_log2, -m_p));
                sum += s[nt][2 * h] + s[nt][2 * h + 1];
            }
        }
        l[h] = l[h] * corr[h] + sum;
    }
}

// Two variants of one kernel, told apart by the tile (the launcher's Tile):
//   - kBlockM == 16 * kNWarps: every warpgroup computes; all threads issue the cp.async loads of the next
//     tile and a block-wide barrier per key tile hands buffers over.
//   - kBlockM == 16 * (kNWarps - 4): warp-specialized: one extra warpgroup (the last) only loads (cp.async,
//     then a proxy fence and an mbarrier arrive per tile), holding few registers (setmaxnreg), and the
//     kBlockM / 64 consumer warpgroups never wait on each other: each waits on "tile landed" mbarriers
//     and releases buffers through "buffer free" mbarriers.
// Two blocks per SM for the first variant where a thread's S, O and P fragments are small
// (kBlockN + kHeadDim <= 128: at most 128 registers with two 8-warp blocks), so that one block's prologue
// (Q and K_0 loads, exposed) and epilogue hide under the other's main loop; and for the warp-specialized one with a
// single computing warpgroup (its registers from half the SM's: two blocks' computing warpgroups out of phase).
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct Sm90Config {
    static constexpr bool kWS = kBlockM == 16 * (kNWarps - 4);
    static constexpr int kNWG = kBlockM / 64;  // computing (consumer) warpgroups
    static constexpr int kMinBlocks =
        ((!kWS && kNWarps == 8 && kBlockN + kHeadDim <= 128) || (kWS && kNWG == 1)) ? 2 : 1;
    // The producer warpgroup's registers and the computing warpgroups' (setmaxnreg): [fwd persistent]'s producer
    // walks the tiles too, and holds 32 (at 24 ptxas spilled its loop's values).
    // [prefill append]'s producer (its copy loops spilled at 24) the persistent form's 32.
    __host__ __device__ static constexpr int producer_regs(bool persistent, bool append = false) {
        return persistent || append ? 32 : 24;
    }
    // (setmaxnreg moves registers within what the block was given at launch, the __launch_bounds__ cap times its
    // threads: 168 x 384 at d 128, less than the 65536 of the SM; asking for more than that waits forever)
    static constexpr int kLaunchRegs = 65536 / kMinBlocks / (kNWarps * 32) / 8 * 8;
    __host__ __device__ static constexpr int consumer_regs(bool persistent, bool append = false) {
        const int raw = (kLaunchRegs * kNWarps * 32 - 128 * producer_regs(persistent, append)) / (kNWG * 128) / 8 * 8;
        return raw > 240 ? 240 : raw;
    }
    static constexpr int kProducerRegs = producer_regs(false);
    static constexpr int kConsumerRegs = consumer_regs(false);
};

// [ping-pong] With a TMA producer and two computing warpgroups, the two take turns issuing their products (S_j, then
// P_{j-1} V_{j-1}): each waits for its turn on a named barrier before issuing and hands the turn over right after, so
// one warpgroup's softmax runs while the tensor cores work on the other's products (FlashAttention-3's warpgroup
// schedule). Barrier kTurnBar + wg is warpgroup wg's turn (ids after warpgroup_sync's 1 and 2: two computing
// warpgroups only, a third's warpgroup_sync would take id 3). Compiled out with
// -DCUFLASH_FWD_PINGPONG=0 (for comparisons).
#ifndef CUFLASH_FWD_PINGPONG
#define CUFLASH_FWD_PINGPONG 1
#endif
constexpr int kTurnBar = 3;
// A thread's role in flash_fwd_sm90's tile (run_tile): the producer warpgroup's copies or the computing warpgroups'
// products (without a producer: every thread, loads included), or kSplit: by warpgroup, registers moved (setmaxnreg).
constexpr int kProduce = 0, kConsume = 1, kSplit = 2;


// The tensor maps of the TMA entry point: q, k and v as 4-d tensors (columns, rows, heads, batch; a packed batch's
// batch axis of one).
struct FwdMaps {
    const TensorMap *q, *k, *v;
    const TensorMap *k_new = nullptr, *v_new = nullptr;  // [prefill append] the new keys' and values'
};

// [prefill append] Chunked prefill's append fused into its forward (flash_fwd_sm90_tma_append_kernel): the call's
// new keys and values (k_new, v_new: batch x seqlen_new x heads_kv x kHeadDim, element strides; seqlen_new == the
// query rows) belong at slots cache_seqlens[b] .. of the cache, which is the kernel's k and v (capacity slots). The
// kernel's key count of sequence b is cache_seqlens[b] + seqlen_new, or -1 (void rows, nothing written) where
// cache_seqlens[b] is negative or leaves no room (the decode kernels' [decode guard]); VariantParams' seqused_k is
// cache_seqlens. Key tile j is copied from where its keys are: wholly below cache_seqlens[b], through the cache's
// map; wholly at or past it, through k_new's and v_new's maps (row - cache_seqlens[b]: rows past the new ones read
// zeros); the one tile that straddles it, through the cache's map after the block's producer warps 1-3 have written
// that tile's new rows into the cache (fence.proxy.async.global, then the straddle mbarrier). The cache gets every
// new row from the blocks of each key/value head's first query head (warps 2 and 3 of their producer warpgroup, the
// rows of their query tile), which no block of the launch reads back (the straddling rows are written by their
// readers too: the same bytes). So no block waits for another, and the append needs no launch of its own.
struct PrefillAppend {
    const int* cache_seqlens;
    const u16* k_new;
    const u16* v_new;
    i64 kn_sb, kn_ss, kn_sh, vn_sb, vn_ss, vn_sh;
    int seqlen_new;
    int capacity;
    u16* k_cache;  // the kernel's k and v, to write into (its k and v parameters are read-only)
    u16* v_cache;
};

// [prefill append] BlockInfo's key count and band for the appended sequence (its len_k read cache_seqlens[b]).
template <class V>
__device__ __forceinline__ void append_lengths(BlockInfo<V>& bi, const VariantParams& p, const PrefillAppend& ap) {
    const int cached = bi.len_k;
    bi.len_k = (cached >= 0 && cached <= ap.capacity - ap.seqlen_new) ? cached + ap.seqlen_new : -1;
    bi.offset = p.bottom_right ? bi.len_k - bi.len_q : 0;
    bi.lo = bi.offset - p.window_left;
    bi.hi = bi.offset + p.window_right;
}

// Template arguments as the launcher's tile table: kBlockM query rows (kBlockM / 64 computing
// warpgroups), kBlockN key rows, kNWarps warps (see Sm90Config), kStages = 2 K/V buffers; kTma: the
// warp-specialized variant's producer copies through `maps`. [tma tail] Where a sequence's keys end inside the
// tensor (a packed batch, key counts), a box reads the rows past them as they are (the next sequence's, padding),
// not zeros: their scores are masked (assigned -inf), but 0 x a NaN or an infinity there would reach O through
// P V, so the producer's first warp zeroes the last V tile's rows past the keys before the computing warpgroups'
// last P V reads it (barrier tail_v).
//
// [fp8] T = e4m3 (the V^T entry point, flash_fwd_sm90_vt_kernel): q, k and v in e4m3, O in bf16. Q and K tiles are
// the 16-bit ones' bytes (kHeadDim bytes a row, 128-column boxes), S = Q K^T by k32 steps; V arrives as V^T (maps.v:
// kHeadDim rows of the keys, in Sm90Elem's vt_key order inside each 16; transpose_v_kernel writes it), K-major B of
// P V, P packed to e4m3 by p_to_e4m3 at 2^8 its 16-bit value ([fp8 p]). descale (3 x batch x heads_kv float32: q's,
// k's, v's factors per key/value head, FlashAttention-3's q_descale, k_descale, v_descale; or null, all 1): the raw
// scores are multiplied by q's and k's before any mod or mask, O by v's. [tf32] T = tf32 (float32 inputs, one TF32
// product): the same with 4-byte elements, k8 steps, V^T's keys in groups of 8, P rounded to TF32 as the A fragment
// (p_to_tf32), O stored as float32 from registers. [f16x2] T = f16x2 (float32 inputs as pairs of fp16 parts,
// fp32_precision="fp16x3"): each 4-byte element two fp16 parts, a row's high parts then its low parts
// (split_f16x2_kernel), so the tiles are the 16-bit kernel's at twice the head dim, V read MN-major as the 16-bit
// kernel reads it; S = Qh Kh^T + (Qh Kl^T + Ql Kh^T) / 2^11 (the low parts of q and k carry 2^11; their products in
// an accumulator of their own), P split in registers at 2^14 its value (p_to_f16x2), each tile's P V (Pl Vh + Ph Vl,
// then Ph Vh) in an accumulator of its own added to O in float32, the products of a tile one after the other (the
// ping-pong overlaps the warpgroups' softmax); descale: the bits of q's, k's and v's largest magnitudes, whose powers
// of two the split multiplied by (f16x2_exponent). All three: padded batches only, no staged bias, no dropout, whole
// head dims (Sm90Elem: the element policies).
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool kTma = false,
          bool kPersistent = false, bool kAppend = false>
__device__ __forceinline__ void flash_fwd_sm90(CUFLASH_FWD_PARAMS(u16), const VariantParams vp,
                                               const FwdMaps maps = FwdMaps{}, const float* descale = nullptr,
                                               const int batch = 0, int* tile_counter = nullptr,
                                               const PrefillAppend ap = PrefillAppend{}) {
    using Cfg = Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>;
    constexpr bool kWS = Cfg::kWS;
    static_assert(!kTma || kWS, "TMA: a producer warpgroup");
    using E = Sm90Elem<T>;
    using W = Wgmma<typename E::Mma>;
    constexpr bool kVt = E::kVt;                          // [fp8], [tf32]: V read as V^T
    constexpr bool kFp8 = E::kBytes == 1;                 // (its descale factors)
    constexpr bool kTwoParts = E::kSplit;                 // [f16x2]: two fp16 parts an operand
    constexpr bool kDescale = kFp8 || kTwoParts;          // q's, k's and v's factors
    constexpr bool kRescaleSkip = CUFLASH_FWD_RESCALE_SKIP < 0 ? kFp8 : CUFLASH_FWD_RESCALE_SKIP != 0;
    constexpr bool kExp16 = kFp8 && CUFLASH_FP8_EXP16;  // [fp8 exp16]
    constexpr bool kOutF32 = sizeof(typename E::Out) == 4;  // [tf32]: O stored as float32 from registers
    static_assert(!(kVt || kTwoParts) || (kTma && !V::Is_varlen && !V::Has_seqused && !V::Bias::kStaged &&
                                          !V::Has_dropout && !V::Pads_head_dim && kHeadDim * E::kBytes % 128 == 0 &&
                                          kBlockN * E::kBytes % 128 == 0),
                  "[fp8], [tf32], [f16x2]: the TMA entry point, padded batches, no staged bias or dropout, head dims "
                  "of whole 128-byte rows, key tiles of whole 128-byte boxes of V^T");
    constexpr int kElemBytes = E::kBytes;
    constexpr int kKStep = E::kKStep;        // the k of one wgmma (32 bytes of each operand row)
    constexpr int kPOff = E::kPOff;          // [fp8 p]
    constexpr bool kTmaTail = kTma && (V::Is_varlen || V::Has_seqused);  // [tma tail]
    // [variant head dim] Head dims below the kernel's from the TMA entry point only: the maps hold the arrays' head
    // dims, so a box reads zeros in the columns past them (they add nothing to Q K^T, and give O columns that are not
    // stored); the cp.async loads read whole rows.
    static_assert(!V::Pads_head_dim || kTma, "head dims below the kernel's: the TMA entry point");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dim: whole 64-column swizzle blocks, wgmma n <= 256");
    static_assert((kBlockN % 64 == 0 || kBlockN == 80) && kBlockN <= 256, "key tile: wgmma n = kBlockN (64k or 80)");
    static_assert(kNWarps % 4 == 0 && kNWarps >= 4 && kNWarps <= 16, "one to four warpgroups");
    static_assert(kBlockM % 64 == 0 && (kBlockM == 16 * kNWarps || kWS), "each computing warpgroup owns 64 query rows");
    static_assert(kStages == 2, "two K/V buffers (the loop loads one tile ahead)");
    constexpr bool kStagedBias = V::Bias::kStaged;  // [variant bias tile]
    static_assert(!kStagedBias || !kWS, "a staged bias runs without a producer warpgroup (all threads load)");
    constexpr int kLoaders = kWS ? 128 : kNWarps * 32;  // threads that issue the loads
    constexpr int kNT = kBlockN / 8;    // n8 fragments of a score row block
    constexpr int kDT = kHeadDim / 8;   // n8 fragments of an output row block
    constexpr int kKT = kHeadDim / kKStep;  // k steps of Q K^T
    constexpr int kPT = kBlockN / kKStep;   // k steps of P V
    constexpr int kKVTile = kBlockN * kHeadDim * kElemBytes / 2;  // (in 16-bit units)
    // [fwd persistent] one block per SM (two for one computing warpgroup) walks the query tiles (run_tiles); 16-bit
    // padded batches from the TMA entry point, O staged in a buffer of its own (sO) so that the next tile's Q lands
    // while this tile's last P V and output run.
    static_assert(!kPersistent || (kTma && !kVt && !kTwoParts && !V::Is_varlen && !V::Has_seqused && !kStagedBias),
                  "[fwd persistent]: the 16-bit TMA entry point, padded batches without key counts");
    static_assert(!kAppend || (kTma && !kPersistent && !kVt && !kTwoParts && !V::Is_varlen && V::Has_seqused &&
                               !V::Has_block_map),
                  "[prefill append]: the 16-bit TMA entry point, one tile a block, padded batches with key counts, "
                  "no block map");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Swizzle atoms need 1024-byte alignment, whatever the alignment of the dynamic shared memory base.
    const u32 raw_addr = smem_u32(smem_raw);
    u16* sQ = reinterpret_cast<u16*>(smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr));
    // (Q's tile, where O is staged too: 2 bytes an element for 8- and 16-bit inputs, 4 for tf32's Q)
    u16* sK = sQ + kBlockM * kHeadDim * (kElemBytes > 2 ? kElemBytes : 2) / 2;  // 2 buffers
    u16* sV = sK + 2 * kKVTile;         // 2 buffers
    // mbarriers of the warp-specialized variant: Q landed, K/V buffer landed, K/V buffer free.
    const u32 bar = smem_u32(sV + 2 * kKVTile);
    const u32 full_q = bar, full_k = bar + 8, full_v = bar + 24, free_k = bar + 40, free_v = bar + 56;
    const u32 tail_v = bar + 72;  // (TMA with sequence lengths: the last V tile's rows past the keys zeroed)
    const u32 free_q = bar + 80;  // [fwd persistent] every computing thread's last S of a tile has retired
    // [fwd persistent] the tile schedule (run_tiles): its two slots' mbarriers and the slots, to bar + 128
    const u32 sched_full = bar + 88, sched_empty = bar + 104;
    const u32 straddle = bar + 88;  // [prefill append] (not persistent) the straddling key tile's new rows written
    volatile int* sched = reinterpret_cast<volatile int*>(reinterpret_cast<unsigned char*>(sV + 2 * kKVTile) + 120);
    // [variant bias tile] 2 buffers of kBlockM x kBlockN bias entries, after the mbarriers' 128 bytes.
    using BiasT = typename BlockInfo<V>::BiasT;
    BiasT* sBias = reinterpret_cast<BiasT*>(reinterpret_cast<unsigned char*>(sV + 2 * kKVTile) + 128);
    constexpr int kBiasTile = kBlockM * kBlockN;
    // O's staging tile ([fwd persistent]: after the mbarriers; else the Q buffer, free once the last S has retired)
    u16* sO = kPersistent ? reinterpret_cast<u16*>(reinterpret_cast<unsigned char*>(sV + 2 * kKVTile) + 128) : sQ;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp_in_wg = (tid >> 5) & 3;

    // One query tile (m_block, h, b) by one role: the producer warpgroup's copies (kProduce), the computing
    // warpgroups' products (kConsume), or both (no producer: every thread loads). kv_base: the K/V tiles the block's
    // earlier query tiles streamed through the two buffers (their index and phase continue from there); q_loads: the
    // Q tiles it loaded before ([fwd persistent]; 0 and 0 for a block of one tile). Returns the tile's key tiles.
    auto run_tile = [&](const int m_block, const int h, const int b, const int kv_base, const int q_loads,
                        const int role) -> int {
    const int h_kv = h / group;
    const int m0 = m_block * kBlockM;

    BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if constexpr (kAppend) append_lengths(bi, vp, ap);
    if (bi.past_queries(m0)) return 0;  // a shorter sequence of a packed batch (the whole block leaves together)
    const int len_q = bi.len_q;
    // [fp8] q's and k's factors scale the raw scores (before the mods and masks, whose constants are in real raw-score
    // units), v's the output
    float qk_descale = 1.f, v_descale = 1.f;
    if constexpr (kFp8) {
        if (descale != nullptr) {
            const int batches = kPersistent ? batch : int(gridDim.z);
            const int per = batches * (heads_q / group), at = b * (heads_q / group) + h_kv;
            qk_descale = descale[at] * descale[per + at];
            v_descale = descale[2 * per + at];
        }
    }
    if constexpr (kTwoParts) {
        // [f16x2] the kernel reads q, k and v times 2^e_q, 2^e_k, 2^e_v (descale: the bits of each one's largest
        // magnitude, from which split_f16x2_kernel took e)
        const u32* max_bits = reinterpret_cast<const u32*>(descale);
        qk_descale = pow2f(-f16x2_exponent(max_bits[0])) * pow2f(-f16x2_exponent(max_bits[1]));
        v_descale = pow2f(-f16x2_exponent(max_bits[2]));
    }
    // [fp8 fold] Without score mods, a positive qk_descale goes into the softmax's scale instead of multiplying every
    // raw score (the row maximum of the unscaled scores is the scaled ones' over qk_descale > 0): one multiply a
    // score less: +6-14 % at d 128 (H200, 2026-11-28).
    const bool fold_descale = (kTwoParts || (CUFLASH_FP8_FOLD_DESCALE && kFp8)) && !V::Has_mod && qk_descale > 0.f;
    const float softmax_log2 = fold_descale ? scale_log2 * qk_descale : scale_log2;

    // Key tiles [n_begin, n_begin + n_end) hold the keys this query tile sees (causal, window). K and V
    // start at tile n_begin, so the loops count tiles (buffers, barrier phases) from there.
    const TileLoop<V> keys = bi.template key_loop<kBlockN, kBlockM>(m_block);  // [variant mask] a block map's list
    const int n_begin = keys.first, n_end = keys.count;
    const auto tile_row = [&](int j) { return (keys.tile(j) - n_begin) * kBlockN; };  // from tile n_begin on
    const int n_shift = n_begin * kBlockN;
    const int len_k = bi.len_k - n_shift;
    // The block's K/V tile of key tile j (producer and computing warpgroups alike): its buffer (slot & 1), its
    // barriers' phase (slot >> 1 & 1).
    const auto slot = [&](int j) { return kv_base + j; };

    const u16* qg = bi.q_rows(q, b, h, q_sb, q_sh, q_ss);
    const u16* kg = bi.k_rows(k, b, h_kv, k_sb, k_sh, k_ss) + (i64)n_shift * k_ss;
    const u16* vg = bi.k_rows(v, b, h_kv, v_sb, v_sh, v_ss) + (i64)n_shift * v_ss;

    auto load_k = [&](int j, int ltid) {
        if constexpr (kWS) {
            load_tile_sw128_lean<kBlockN, kHeadDim, kLoaders>(sK + (j & 1) * kKVTile, kg, k_ss, tile_row(j), len_k, ltid);
        } else {
            load_tile_sw128<kBlockN, kHeadDim, kLoaders>(sK + (j & 1) * kKVTile, kg, k_ss, tile_row(j), len_k, ltid);
        }
    };
    auto load_v = [&](int j, int ltid) {
        if constexpr (kWS) {
            load_tile_sw128_lean<kBlockN, kHeadDim, kLoaders>(sV + (j & 1) * kKVTile, vg, v_ss, tile_row(j), len_k, ltid);
        } else {
            load_tile_sw128<kBlockN, kHeadDim, kLoaders>(sV + (j & 1) * kKVTile, vg, v_ss, tile_row(j), len_k, ltid);
        }
    };

    // [variant bias tile] The bias of key tile j into buffer j % 2 (all threads; the caller commits).
    auto load_bias = [&](int j) {
        if constexpr (kStagedBias) {
            load_bias_tile<V, kBlockM, kBlockN, kLoaders>(sBias + (j & 1) * kBiasTile, bi, m0, n_shift + tile_row(j),
                                                          seqlen_k, tid);
        }
    };

    // [prefill append] The producer warpgroup's warps 1-3 (t: 0..95), in a sequence that appends (len_k >= 0): the
    // three write the new rows of the key tile that straddles cache_seqlens[b], where this block reads that tile, into
    // the cache and tell the copying thread (straddle: each thread's fence, then its arrival); then warps 2 and 3 of
    // the blocks of each key/value head's first query head write the new rows of their query tile into the cache
    // (16-byte chunks, v's rows then k's, as the decode kernels' append).
    auto append_rows = [&](const int t) {
        if constexpr (kAppend) {
            if (bi.len_k < 0) return;
            const int cached = bi.len_k - ap.seqlen_new;
            constexpr int kChunks = kHeadDim / 8;
            // new rows [first, first + count) of v, then of k, by `stride` threads: thread t0 copies chunk t0 % kChunks
            // of every (stride / kChunks)-th row from first + t0 / kChunks (threads past the last whole row group
            // idle), a row pointer stepped along (one row in flight: two spilled at the producer's 32 and 40
            // registers; the straddling tile is reached late in a long cache's loop, the case this form is for)
            auto write = [&](const int first, const int count, const int t0, const int stride) {
                const int step = stride / kChunks, c = (t0 % kChunks) * 8, r0 = t0 / kChunks;
                if (r0 >= step) return;
#pragma unroll 1
                for (int is_k = 0; is_k < 2; ++is_k) {
                    const i64 src_ss = is_k ? ap.kn_ss : ap.vn_ss, dst_ss = is_k ? k_ss : v_ss;
                    const u16* src = (is_k ? ap.k_new + b * ap.kn_sb + h_kv * ap.kn_sh
                                           : ap.v_new + b * ap.vn_sb + h_kv * ap.vn_sh) + (first + r0) * src_ss + c;
                    u16* dst = (is_k ? ap.k_cache + b * k_sb + h_kv * k_sh : ap.v_cache + b * v_sb + h_kv * v_sh) +
                               (cached + first + r0) * dst_ss + c;
#pragma unroll 1
                    for (int r = r0; r < count; r += step, src += step * src_ss, dst += step * dst_ss) {
                        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
                    }
                }
            };
            const int js = cached / kBlockN;  // the key tile holding slot `cached`
            if (cached % kBlockN != 0 && js >= n_begin && js < n_begin + n_end) {
                write(0, min((js + 1) * kBlockN - cached, ap.seqlen_new), t, 96);
                asm volatile("fence.proxy.async.global;" ::: "memory");  // (before the map's copy reads them)
                mbar_arrive(straddle);  // (each of the 96 threads)
            }
            if (t >= 32 && h % group == 0 && m0 < ap.seqlen_new) {
                write(m0, min(kBlockM, ap.seqlen_new - m0), t - 32, 64);
            }
        }
    };

    // The producer warpgroup of the warp-specialized variant: loads Q, then K_0, V_0, K_1, V_1, ... one
    // commit group each; once a group has landed (wait_group 1 after the next commit), fence it for the
    // tensor cores and arrive on its "landed" barrier. Buffer j % 2 is refilled once both computing
    // warpgroups have released tile j - 2 from it.
    auto produce = [&]() {
        const int ptid = tid - Cfg::kNWG * 128;
        if constexpr (kAppend) {
            if (ptid >= 32) {  // [prefill append] warps 1-3: the new rows into the cache
                append_rows(ptid - 32);
                return;
            }
        }
        if (n_end == 0) return;
        if constexpr (kTma) {
            // One thread: Q, then K_j and V_j into buffer j % 2 once it is free. A tile is kHeadDim / 64 boxes of 64
            // columns by its rows, its barrier told their bytes first. (Rows in the tensor: a packed sequence's
            // start added, its batch coordinate 0.)
            if (ptid >= (kTmaTail ? 32 : 1)) return;
            if (ptid == 0) {
                const int batch = V::Is_varlen ? 0 : b;
                auto copy = [&](u32 dst, const TensorMap* map, u32 landed, int rows, int row, int head) {
                    mbar_expect_tx(landed, rows * kHeadDim * kElemBytes);
                    tma_load_tile<kHeadDim, 128 / kElemBytes>(dst, map, landed, rows, row, head, batch);
                };
                auto copy_q = [&]() {
                    // [fwd persistent] once every computing thread's last S of the block's previous tile has retired
                    if (kPersistent && q_loads > 0) mbar_wait(free_q, (q_loads - 1) & 1);
                    copy(smem_u32(sQ), maps.q, full_q, kBlockM, bi.q0 + m0, h);
                };
                if constexpr (!kPersistent) copy_q();
                for (int j = 0; j < n_end; ++j) {
                    const int g = slot(j), buf = g & 1;
                    int row = bi.k0 + n_shift + tile_row(j);
                    const TensorMap *k_src = maps.k, *v_src = maps.v;
                    if constexpr (kAppend) {  // [prefill append] the tile from where its keys are
                        const int cached = bi.len_k - ap.seqlen_new;
                        if (row >= cached) {
                            k_src = maps.k_new;
                            v_src = maps.v_new;
                            row -= cached;
                        } else if (row + kBlockN > cached) {
                            mbar_wait(straddle, 0);
                        }
                    }
                    if (g >= 2) mbar_wait(free_k + 8 * buf, ((g >> 1) - 1) & 1);
                    copy(smem_u32(sK + buf * kKVTile), k_src, full_k + 8 * buf, kBlockN, row, h_kv);
                    if (kPersistent && j == 0) copy_q();  // (K_0's buffer frees before Q: it first)
                    if (g >= 2) mbar_wait(free_v + 8 * buf, ((g >> 1) - 1) & 1);
                    if constexpr (kVt) {
                        // [fp8], [tf32] V^T: its kHeadDim rows, the tile's keys from key `row` as the columns
                        const u32 landed = full_v + 8 * buf;
                        mbar_expect_tx(landed, kHeadDim * kBlockN * kElemBytes);
                        tma_load_tile<kBlockN, 128 / kElemBytes>(smem_u32(sV + buf * kKVTile), maps.v, landed,
                                                                 kHeadDim, 0, h_kv, batch, row);
                    } else {
                        copy(smem_u32(sV + buf * kKVTile), v_src, full_v + 8 * buf, kBlockN, row, h_kv);
                    }
                }
            }
            if constexpr (kTmaTail) {
                // [tma tail] The first warp: once the last V tile has landed, its rows from `kept` on are zeroed (each
                // row's 128 bytes in every 64-column block: the swizzle moves chunks only within a row), fenced for
                // the tensor cores, and the computing warpgroups told (tail_v counts the warp's 32 threads).
                __syncwarp();
                const int last = n_end - 1, kept = len_k - tile_row(last);
                if (kept < kBlockN) {
                    mbar_wait(full_v + 8 * (last & 1), (last >> 1) & 1);
                    u16* tile = sV + (last & 1) * kKVTile;
                    const int first = max(kept, 0), rows = kBlockN - first;
                    for (int i = ptid; i < rows * (kHeadDim / 64) * 8; i += 32) {  // (16-byte chunks)
                        const int r = first + (i >> 3) % rows, c = (i >> 3) / rows;
                        *reinterpret_cast<uint4*>(tile + c * kBlockN * 64 + r * 64 + (i & 7) * 8) = uint4{0, 0, 0, 0};
                    }
                    fence_proxy_async();
                    mbar_arrive(tail_v);
                }
            }
            return;
        }
        load_tile_sw128_lean<kBlockM, kHeadDim, kLoaders>(sQ, qg, q_ss, m0, len_q, ptid);
        cp_async_commit();
        u32 landed = full_q;
        auto hand_over = [&](u32 next) {  // the group before the newest has landed
            cp_async_wait<1>();
            fence_proxy_async();
            mbar_arrive(landed);
            landed = next;
        };
        for (int j = 0; j < n_end; ++j) {
            const int g = slot(j), buf = g & 1;
            if (g >= 2) mbar_wait(free_k + 8 * buf, ((g >> 1) - 1) & 1);
            load_k(j, ptid);
            cp_async_commit();
            hand_over(full_k + 8 * buf);
            if (g >= 2) mbar_wait(free_v + 8 * buf, ((g >> 1) - 1) & 1);
            load_v(j, ptid);
            cp_async_commit();
            hand_over(full_v + 8 * buf);
        }
        cp_async_wait<0>();
        fence_proxy_async();
        mbar_arrive(landed);
    };

    // [ping-pong] warpgroup wg's turn to issue (turn), and the other's (pass_turn; the last turn of warpgroup 1 is
    // handed to no one, warpgroup 0 having issued its last). [fwd persistent] The turns run on from tile to tile:
    // warpgroup 1 hands its last turn of a tile to warpgroup 0's first of the next (so that warpgroup 0 starts it while
    // warpgroup 1 stores the output), gives warpgroup 0 the first turn only in the block's first tile with keys, and
    // warpgroup 0 takes the last one after its last tile (run_tiles).
    constexpr bool kPingpong = CUFLASH_FWD_PINGPONG && kTma && Cfg::kNWG == 2;
    auto turn = [&]() {
        if constexpr (kPingpong) named_bar_sync(kTurnBar + wg, 256);
    };
    auto pass_turn = [&](bool last) {
        if constexpr (kPingpong) {
            if (kPersistent || !(last && wg == 1)) named_bar_arrive(kTurnBar + (wg ^ 1), 256);
        }
    };
    const bool first_turns = !kPersistent || q_loads == 0;  // (warpgroup 1 gives warpgroup 0 the first turn)

    // A computing warpgroup: 64 query rows.
    auto consume = [&]() {
        const int row_base = m0 + wg * 64 + warp_in_wg * 16;  // this warp's fragment rows: + g, + g + 8
        // Descriptors: this warpgroup's 64 rows of Q; K and V buffers (see hopper_tiles.cuh for the layout).
        const u32 q_addr = smem_u32(sQ) + wg * 64 * 128;
        const u32 k_addr = smem_u32(sK), v_addr = smem_u32(sV);
        auto desc_q = [&](int kk) { return sw128_desc(q_addr + (kk >> 2) * kBlockM * 128 + (kk & 3) * 32, 16, 1024); };
        auto desc_k = [&](int buf, int kk) {
            return sw128_desc(k_addr + buf * kKVTile * 2 + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32, 16, 1024);
        };
        // ([f16x2] part 1: V's low parts, the blocks after the high parts' kHeadDim / 64; Q's and K's: k steps kKT on)
        auto desc_v = [&](int buf, int kk, int part = 0) {
            if constexpr (kVt) {  // [fp8], [tf32] V^T K-major, as K in S = Q K^T
                return sw128_desc(v_addr + buf * kKVTile * 2 + (kk >> 2) * kHeadDim * 128 + (kk & 3) * 32, 16, 1024);
            } else {
                return sw128_desc(v_addr + buf * kKVTile * 2 + part * (kHeadDim / 64) * kBlockN * 128 + kk * 2048,
                                  kBlockN * 128, 1024);
            }
        };

        float acc[kDT][4];
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
        float m[2] = {-CUFLASH_INF, -CUFLASH_INF}, l[2] = {0.f, 0.f}, corr[2];
        float s[kNT][4];
        u32 p[kPT][4];
        u32 ph[kExp16 ? kNT : 1][2];  // [fp8 exp16] P as fp16 pairs
        // [f16x2] S's cross products (the low parts carry 2^11), P's low parts, and P V of one key tile (added to O in
        // float32: the tensor core's sums round toward zero, which over many tiles would bias a running O)
        float sx[kTwoParts ? kNT : 1][4];
        u32 p2[kTwoParts ? kPT : 1][4];
        float ot[kTwoParts ? kDT : 1][4];

        // [fa2-fwd 2] S = Q K_buf^T (raw scores), then the mask of key tile j where it is needed. [f16x2] S = Qh Kh^T,
        // sx = Qh Kl^T + Ql Kh^T.
        auto scores = [&](int buf) {
#pragma unroll
            for (int kk = 0; kk < kKT; ++kk) {
                W::ss(s, desc_q(kk), desc_k(buf, kk), kk > 0 ? 1 : 0, Int<kBlockN>());
            }
            if constexpr (kTwoParts) {
#pragma unroll
                for (int kk = 0; kk < kKT; ++kk) {
                    W::ss(sx, desc_q(kk), desc_k(buf, kKT + kk), kk > 0 ? 1 : 0, Int<kBlockN>());
                }
#pragma unroll
                for (int kk = 0; kk < kKT; ++kk) W::ss(sx, desc_q(kKT + kk), desc_k(buf, kk), 1, Int<kBlockN>());
            }
            wgmma_commit();
        };
        // [variant mod] and [variant mask] of key tile j (counted from n_begin).
        auto mask = [&](int j) {
            const int n0 = n_shift + tile_row(j);
            if constexpr (kTwoParts) {  // [f16x2] S += sx / 2^11
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[nt][e] = fmaf(sx[nt][e], 4.8828125e-4f, s[nt][e]);
                }
            }
            if (kDescale && !fold_descale) {
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[nt][e] *= qk_descale;
                }
            }
            if constexpr (kStagedBias) {
                mod_scores<false>(s, bi, row_base, n0, lane, keys.partial(j),
                                  BiasTile<V, kBlockN>{sBias + (j & 1) * kBiasTile, m0, n0});
            } else {
                mod_scores<false, kTwoParts>(s, bi, row_base, n0, lane, keys.partial(j));
            }
            const bool mask_mod = keys.mask_mod_in_mask(j);
            if (bi.needs_mask(m0, kBlockM, n0, kBlockN) || mask_mod) {
                mask_block<false>(s, bi, row_base, n0, lane, -CUFLASH_INF, mask_mod);
            }
        };
        // [fa2-fwd 5] O += P V_buf, P (already 16-bit) straight from registers. [f16x2] ot = P V of the tile: Pl Vh +
        // Ph Vl, then Ph Vh (the tensor core adds each k step's products to its sum rounded toward zero: the cross
        // products first, while the sum and so its truncations are small).
        auto pv = [&](int buf) {
            if constexpr (kTwoParts) {
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) {
                    W::rs_tb(ot, p2[kk], desc_v(buf, kk), kk > 0 ? 1 : 0, Int<kHeadDim>());
                    W::rs_tb(ot, p[kk], desc_v(buf, kk, 1), 1, Int<kHeadDim>());
                }
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) W::rs_tb(ot, p[kk], desc_v(buf, kk), 1, Int<kHeadDim>());
            } else {
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) {
                    if constexpr (kVt) {
                        W::rs(acc, p[kk], desc_v(buf, kk), 1, Int<kHeadDim>());
                    } else {
                        W::rs_tb(acc, p[kk], desc_v(buf, kk), 1, Int<kHeadDim>());
                    }
                }
            }
            wgmma_commit();
        };
        // [variant dropout] The keep bits of key tile j, drawn while the tensor cores compute S_j (they depend
        // on the indices only), applied to P after the row sum.
        u32 keep[V::Has_dropout ? (4 * kNT + 31) / 32 : 1];
        auto draw_keep = [&](int j) {
            if constexpr (V::Has_dropout) {
                dropout_bits<false, kNT>(keep, bi, row_base, n_shift + tile_row(j), lane);
                keep_fence(keep);
            }
        };
        // [variant dropout] (after the row sum) and P to 16 bits (e4m3: [fp8 p]; tf32: [vt p]; [f16x2]: two parts) for
        // the A operand of P V.
        auto pack_p = [&]() {
            if constexpr (V::Has_dropout) dropout_apply<kNT>(s, keep, 1.f);
#pragma unroll
            for (int kk = 0; kk < kPT; ++kk) {
                if constexpr (kExp16) {  // [fp8 exp16]
                    p_f16x2_to_e4m3<kNT>(p[kk], ph, kk);
                } else if constexpr (kFp8) {
                    p_to_e4m3<kNT>(p[kk], s, kk);
                } else if constexpr (kTwoParts) {
                    p_to_f16x2<kNT>(p[kk], p2[kk], s, kk);
                } else if constexpr (kVt) {
                    p_to_tf32<kNT>(p[kk], s, kk);
                } else {
                    c_to_a<T, kNT>(p[kk], s, kk);
                }
            }
        };
        auto rescale_o = [&]() {
            if constexpr (kRescaleSkip) {  // [fwd rescale skip]
                if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
            }
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                acc[dt][0] *= corr[0];
                acc[dt][1] *= corr[0];
                acc[dt][2] *= corr[1];
                acc[dt][3] *= corr[1];
            }
        };
        // All threads' cp.async of the previous commit group have landed and are visible to wgmma.
        auto landed_all = [&]() {
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();
        };

        // [fwd persistent] Q's buffer released for the next tile once this thread's last S has retired.
        const auto release_q = [&](int j) {
            if constexpr (kPersistent) {
                if (j == n_end - 1) mbar_arrive(free_q);
            }
        };
        if constexpr (kTwoParts) {
            // [f16x2] Each key tile's products one after the other, S_j, then P_j V_j, the warpgroup waiting on each
            // (the other computing warpgroup's products fill the tensor cores meanwhile: [ping-pong], a turn per
            // product): S's two accumulators and P V's (P's two parts, the tile's O) are never live at once, which at
            // d 128 keeps a warpgroup within its registers. O (frame of the row maxima so far) is rescaled before
            // the tile's P V is added.
            if (n_end > 0) {
                mbar_wait(full_q, q_loads & 1);
                if constexpr (kPingpong) {
                    if (wg == 1 && first_turns) pass_turn(false);  // (warpgroup 0 issues first)
                }
                for (int j = 0; j < n_end; ++j) {
                    const int g = slot(j), buf = g & 1, phase = (g >> 1) & 1;
                    mbar_wait(full_k + 8 * buf, phase);
                    turn();
                    wgmma_fence();
                    scores(buf);
                    pass_turn(false);
                    wgmma_wait<0>();
                    fence_regs(s);
                    fence_regs(sx);
                    mbar_arrive(free_k + 8 * buf);
                    mask(j);
                    softmax_step<kNT, kPOff, kRescaleSkip, kExp16>(ph, s, m, l, corr, softmax_log2);
                    rescale_o();
                    pack_p();
                    mbar_wait(full_v + 8 * buf, phase);
                    turn();
                    wgmma_fence();
                    pv(buf);
                    pass_turn(j == n_end - 1);
                    wgmma_wait<0>();
                    fence_regs(ot);
                    mbar_arrive(free_v + 8 * buf);
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[dt][e] += ot[dt][e];
                    }
                }
            }
        } else if (n_end > 0) {
            // [fa2-fwd 1] the query block and K_0, then (in flight during S_0) K_1 and V_0.
            if constexpr (kWS) {
                mbar_wait(full_q, q_loads & 1);
                mbar_wait(full_k + 8 * (slot(0) & 1), (slot(0) >> 1) & 1);
            } else {
                load_tile_sw128<kBlockM, kHeadDim, kLoaders>(sQ, qg, q_ss, m0, len_q, tid);
                load_k(0, tid);
                load_bias(0);
                cp_async_commit();
                landed_all();
            }
            if constexpr (kPingpong) {
                if (wg == 1 && first_turns) pass_turn(false);  // (warpgroup 0 issues first)
            }
            turn();
            wgmma_fence();
            scores(slot(0) & 1);
            pass_turn(false);
            if constexpr (!kWS) {
                if (1 < n_end) {
                    load_k(1, tid);
                    load_bias(1);
                }
                load_v(0, tid);
                cp_async_commit();
            }
            draw_keep(0);
            wgmma_wait<0>();
            fence_regs(s);
            if constexpr (kWS) mbar_arrive(free_k + 8 * (slot(0) & 1));
            release_q(0);
            mask(0);
            softmax_step<kNT, kPOff, kRescaleSkip, kExp16>(ph, s, m, l, corr, softmax_log2);
            pack_p();

            for (int j = 1; j < n_end; ++j) {
                // K_j and V_{j-1} have landed (and, without a producer, every warpgroup's wgmma reads of
                // K_{j-1} and V_{j-2} have retired).
                const int g = slot(j);
                if constexpr (kWS) {
                    mbar_wait(full_k + 8 * (g & 1), (g >> 1) & 1);
                    mbar_wait(full_v + 8 * ((g - 1) & 1), ((g - 1) >> 1) & 1);
                } else {
                    landed_all();
                }
                turn();
                wgmma_fence();
                scores(g & 1);
                pv((g - 1) & 1);
                pass_turn(false);
                if constexpr (!kWS) {  // loads for the next iteration while the tensor cores work
                    // (bias buffer (j + 1) % 2 was last read by mask(j - 1), before landed_all's barrier)
                    if (j + 1 < n_end) {
                        load_k(j + 1, tid);
                        load_bias(j + 1);
                    }
                    load_v(j, tid);
                    cp_async_commit();
                }
                draw_keep(j);
                wgmma_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
                fence_regs(s);
                if constexpr (kWS) mbar_arrive(free_k + 8 * (g & 1));
                release_q(j);
                mask(j);
                softmax_step<kNT, kPOff, kRescaleSkip, kExp16>(ph, s, m, l, corr, softmax_log2);
                wgmma_wait<0>();
                fence_regs(acc);
                if constexpr (kWS) mbar_arrive(free_v + 8 * ((g - 1) & 1));
                // [fa2-fwd 3] rescale O by exp(m_old - m_new), now that P_{j-1} V_{j-1} is in it.
                rescale_o();
                pack_p();
            }
            // The last P V.
            if constexpr (kWS) {
                const int g = slot(n_end - 1);
                mbar_wait(full_v + 8 * (g & 1), (g >> 1) & 1);
                if constexpr (kTmaTail) {  // [tma tail]
                    if (len_k - tile_row(n_end - 1) < kBlockN) mbar_wait(tail_v, 0);
                }
            } else {
                landed_all();
            }
            turn();
            wgmma_fence();
            pv(slot(n_end - 1) & 1);
            pass_turn(true);
            wgmma_wait<0>();
            fence_regs(acc);
            // [fwd persistent] the last V buffer is free for the block's next tile
            if constexpr (kPersistent) mbar_arrive(free_v + 8 * (slot(n_end - 1) & 1));
        }

        // [fa2-fwd 6] O = acc / l, lse = m + log l; rows that saw no key: O = 0, lse = -inf.
        // O goes through this warpgroup's own rows of sO (the Q buffer, where only its own wgmma read them, and
        // those have retired; [fwd persistent] a buffer of its own, once the warpgroup's reads of the block's
        // previous tile are done), then out with 16-byte stores.
        if constexpr (kPersistent) warpgroup_sync(wg);
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float lsum = quad_sum(l[hh]);
            float inv = bi.out_scale(V::Has_dropout ? bi.keep_scale : 1.f, lsum);  // [variant dropout]
            if constexpr (kDescale) inv *= v_descale;
            const int r = wg * 64 + warp_in_wg * 16 + g + 8 * hh;  // row inside the block
            const int row = m0 + r;
            if constexpr (kOutF32) {
                // [tf32] float32 O straight from registers: a thread's two neighbouring columns, 8 bytes a store
                if (row < len_q) {
                    float* og = reinterpret_cast<float*>(o) + b * o_sb + h * o_sh + (i64)(bi.q0 + row) * o_ss;
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        *reinterpret_cast<float2*>(og + dt * 8 + 2 * t) =
                            make_float2(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
                    }
                }
            } else {
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    *reinterpret_cast<u32*>(sO + sw128_offset<kBlockM>(r, dt) + 2 * t) =
                        Elem<typename E::Out>::pack(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
                }
            }
            if (t == 0 && row < len_q) {
                float log2_l = __log2f(lsum);
                if constexpr (kPOff != 0) log2_l -= float(kPOff);  // [fp8 p]
                lse[bi.row_index(h, heads_q, seqlen_q, row)] = bi.row_lse((m[hh] * softmax_log2 + log2_l) * kLn2, lsum);
            }
        }
        if constexpr (!kOutF32) {
            warpgroup_sync(wg);
            constexpr int kChunks = kHeadDim / 8;
            const int v_cols = bi.template v_cols8<kHeadDim>();  // ([variant head dim] the output's 8-column chunks)
            u16* og = o + b * o_sb + h * o_sh + (i64)bi.q0 * o_ss;
            const int wtid = tid & 127;
#pragma unroll
            for (int i = wtid; i < 64 * kChunks; i += 128) {
                const int r = wg * 64 + i / kChunks, c = i % kChunks;
                const int row = m0 + r;
                if (row < len_q && c < v_cols) {
                    *reinterpret_cast<uint4*>(og + (i64)row * o_ss + c * 8) =
                        *reinterpret_cast<const uint4*>(sO + sw128_offset<kBlockM>(r, c));
                }
            }
        }
    };

    if (role == kProduce) {
        produce();
    } else if (role == kConsume || !kWS) {
        consume();
    } else {  // (kSplit: a block of one tile takes its roles here, after the tile's common values)
        if (wg == Cfg::kNWG) {
            setmaxnreg_dec<Cfg::producer_regs(false, kAppend)>();
            produce();
        } else {
            setmaxnreg_inc<Cfg::consumer_regs(false, kAppend)>();
            consume();
        }
    }
    return n_end;
    };  // run_tile

    // The block's query tiles, each by this thread's role: one (grid x: the query tiles last-first, y: heads, z:
    // batch), or [fwd persistent] the tiles a block takes from the launch's tile counter in the one-tile grid's order
    // (query tiles last-first within a head, then heads, then batches: the tiles at work at once share their heads' K
    // and V in L2, and a block that finishes early takes the next, as the hardware starts one-tile blocks): the
    // producer's copying thread takes the next tile once it has issued this one's copies and hands its index to the
    // computing warpgroups through two slots (sched_full / sched_empty mbarriers); an index past the tiles ends both.
    // The counter (tile_counter[0], the tiles taken after each block's first; [1], the blocks done taking) is zero
    // at a launch and set back to zero by the block that finishes taking last.
    auto run_tiles = [&](const int role) {
        if constexpr (kPersistent) {
            const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM, tiles = m_blocks * heads_q * batch;
            int kv_base = 0, q_loads = 0;
            auto run = [&](const int tile) {
                const int hb = tile / m_blocks;
                const int n = run_tile(m_blocks - 1 - tile % m_blocks, hb % heads_q, hb / heads_q, kv_base, q_loads,
                                       role);
                kv_base += n;
                q_loads += n > 0;
            };
            if (role == kProduce) {
                if (tid != Cfg::kNWG * 128) return;  // (one thread copies and takes the tiles)
                for (int i = 0, tile = blockIdx.x;; ++i) {
                    const int slot_i = i & 1;
                    if (i >= 2) mbar_wait(sched_empty + 8 * slot_i, ((i >> 1) - 1) & 1);
                    sched[slot_i] = tile;
                    mbar_arrive(sched_full + 8 * slot_i);
                    if (tile >= tiles) break;
                    run(tile);
                    tile = atomicAdd(tile_counter, 1) + int(gridDim.x);
                }
                if (atomicAdd(tile_counter + 1, 1) == int(gridDim.x) - 1) {  // (every block has taken its last)
                    tile_counter[0] = 0;
                    tile_counter[1] = 0;
                }
            } else {
                for (int i = 0;; ++i) {
                    const int slot_i = i & 1;
                    mbar_wait(sched_full + 8 * slot_i, (i >> 1) & 1);
                    const int tile = sched[slot_i];
                    mbar_arrive(sched_empty + 8 * slot_i);
                    if (tile >= tiles) break;
                    run(tile);
                }
                // ([ping-pong] warpgroup 1's last turn, handed on after the block's last tile with keys)
                if (CUFLASH_FWD_PINGPONG && Cfg::kNWG == 2 && wg == 0 && q_loads > 0) named_bar_sync(kTurnBar, 256);
            }
        } else {
            run_tile(gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z, 0, 0, role);
        }
    };
    if constexpr (kWS) {
        if (tid == 0) {
            constexpr int kLanded = kTma ? 1 : 128;  // (TMA: the issuing thread's arrival with its bytes)
            mbar_init(full_q, kLanded);
            if constexpr (kPersistent) {
                mbar_init(free_q, Cfg::kNWG * 128);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mbar_init(sched_full + 8 * i, 1);                 // the copying thread's index
                    mbar_init(sched_empty + 8 * i, Cfg::kNWG * 128);  // every computing thread read it
                }
            }
            if constexpr (kTmaTail) mbar_init(tail_v, 32);
            if constexpr (kAppend) mbar_init(straddle, 96);  // (the producer's warps 1-3)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mbar_init(full_k + 8 * i, kLanded);
                mbar_init(full_v + 8 * i, kLanded);
                mbar_init(free_k + 8 * i, Cfg::kNWG * 128);
                mbar_init(free_v + 8 * i, Cfg::kNWG * 128);
            }
        }
        __syncthreads();
    }
    // [pdl] key counts (seqused_k) may come from the kernel launched before this one (chunked prefill's append, which
    // also writes the keys): launched with programmatic serialization, the block has set up its barriers meanwhile
    if constexpr (V::Has_seqused && !kAppend) grid_dependency_wait();
    if constexpr (kPersistent) {  // (the roles for the whole loop)
        if (wg == Cfg::kNWG) {
            setmaxnreg_dec<Cfg::producer_regs(true)>();
            run_tiles(kProduce);
        } else {
            setmaxnreg_inc<Cfg::consumer_regs(true)>();
            run_tiles(kConsume);
        }
    } else {
        run_tiles(kSplit);
    }
}


// flash_fwd_sm90's entry points: the launcher's (VariantParams by value) and the flat one (CUFLASH_VARIANT_FLAT_PARAMS)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>::kMinBlocks))
flash_fwd_sm90_kernel(CUFLASH_FWD_PARAMS(u16), const VariantParams vp) {
    flash_fwd_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_FWD_ARGS, vp);
}
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>::kMinBlocks))
flash_fwd_sm90_flat_kernel(CUFLASH_FWD_PARAMS(u16), CUFLASH_VARIANT_FLAT_PARAMS) {
    flash_fwd_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_FWD_ARGS, CUFLASH_VARIANT_FLAT_ARGS);
}
// ... and the TMA one (the warp-specialized tiles: the launcher's ("fwd", "sm90a_tma", d) rows), with the batch size
// and the tensor maps of q, k and v after the launcher's parameters. kPersistent: [fwd persistent] (grid: one block per
// SM, or two for one computing warpgroup; the batch size counts the tiles), else the grid of flash_fwd_sm90.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool kPersistent = false>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>::kMinBlocks))
flash_fwd_sm90_tma_kernel(CUFLASH_FWD_PARAMS(u16), const VariantParams vp, const int batch, int* tile_counter,
                          const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                          const __grid_constant__ TensorMap v_map) {
    flash_fwd_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, true, kPersistent>(
        CUFLASH_FWD_ARGS, vp, FwdMaps{&q_map, &k_map, &v_map}, nullptr, batch, tile_counter);
}

// ... and [prefill append]'s (chunked prefill: the forward over the cache appending the new keys and values first),
// one tile a block, with the append's parameters and the maps of q, k and v (the cache) and of the new keys and
// values after the launcher's parameters.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>::kMinBlocks))
flash_fwd_sm90_tma_append_kernel(CUFLASH_FWD_PARAMS(u16), const VariantParams vp, const PrefillAppend ap,
                                 const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                                 const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap k_new_map,
                                 const __grid_constant__ TensorMap v_new_map) {
    flash_fwd_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, true, false, true>(
        CUFLASH_FWD_ARGS, vp, FwdMaps{&q_map, &k_map, &v_map, &k_new_map, &v_new_map}, nullptr, 0, nullptr, ap);
}

// [fp8 v] V^T for the V^T entry point: v (batch, keys, heads_kv, kHeadDim) elements of T (e4m3: 1 byte, tf32:
// float32), strides v_sb, v_ss, v_sh in bytes, to vt (batch, heads_kv, kHeadDim, keys_16) C-contiguous, keys_16 = keys
// rounded up to 16, each group of Sm90Elem<T>::kVtGroup keys in its vt_key order (the P fragment's), zeros past the
// keys; float32 values rounded to TF32 (to nearest, ties away: wgmma would truncate them). Block (kKeys-key tile, head,
// batch), 256 threads: the tile's rows in with 16-byte loads, out as 16-byte chunks of V^T's rows.
// Key k's row sits at k * kRow + 16 * (k / kPerChunk) bytes of the tile: the keys of each 16-byte chunk of V^T
// shifted by one more 16 bytes, so that the lanes that read the same word of different chunks' keys fall in
// different banks.
//   e4m3 (kKeys 128: V^T's rows leave in whole 128-byte lines where the keys fill the tile): a thread takes one group of 16 keys (a 16-byte chunk
//   of V^T) for 4 consecutive rows of V^T: one 32-bit word of each key's row in, 4 x 4 bytes transposed by __byte_perm,
//   4 chunks out; a warp's 8 groups x 4 rows' words fall in all 32 banks.
//   tf32 (kKeys 64): element by element, each rounded; a warp takes 8 chunks (128 bytes of a row) of 4 rows, its
//   reads two to a bank.
template <class T, int kHeadDim, int kKeys>
__global__ void __launch_bounds__(256) transpose_v_kernel(const unsigned char* __restrict__ v,
                                                         unsigned char* __restrict__ vt, int keys, int keys16,
                                                         int heads_kv, i64 v_sb, i64 v_ss, i64 v_sh) {
    using E = Sm90Elem<T>;
    constexpr int kBytes = E::kBytes, kGroup = E::kVtGroup;
    constexpr bool kBytePerm = kBytes == 1;
    static_assert(!kBytePerm || (kGroup == 16 && kKeys == 128), "e4m3: 8 groups of 16 keys a tile");
    constexpr int kRow = kHeadDim * kBytes;
    constexpr int kPerChunk = 16 / kBytes;                                   // keys in a 16-byte chunk of V^T
    __shared__ __align__(16) unsigned char tile[kKeys * kRow + 16 * (kKeys / kPerChunk)];
    const auto row_of = [&](int key) { return key * kRow + 16 * (key / kPerChunk); };
    const int key0 = blockIdx.x * kKeys, h = blockIdx.y, b = blockIdx.z;
    const unsigned char* src = v + b * v_sb + h * v_sh;
    for (int i = threadIdx.x; i < kKeys * kRow / 16; i += 256) {
        const int r = i / (kRow / 16), c = i % (kRow / 16), key = key0 + r;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (key < keys) x = *reinterpret_cast<const uint4*>(src + key * v_ss + c * 16);
        *reinterpret_cast<uint4*>(tile + row_of(r) + c * 16) = x;
    }
    __syncthreads();
    unsigned char* dst = vt + ((i64)(b * heads_kv + h) * kHeadDim) * keys16 * kBytes;
    if constexpr (kBytePerm) {
        constexpr int kChunks = kKeys / 16;
        for (int i = threadIdx.x; i < (kHeadDim / 4) * kChunks; i += 256) {
            const int chunk = i % kChunks, rows = 4 * (i / kChunks), first = key0 + chunk * 16;
            if (first >= keys16) continue;
            u32 x[16];  // bytes rows .. rows + 3 of the group's keys
#pragma unroll
            for (int k = 0; k < 16; ++k) x[k] = *reinterpret_cast<const u32*>(tile + row_of(chunk * 16 + k) + rows);
            u32 w[4][4];  // w[t][j]: word j of V^T row rows + t: byte t of the keys at positions 4j .. 4j + 3
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a = x[E::vt_key(4 * j)], bb = x[E::vt_key(4 * j + 1)];
                const u32 c = x[E::vt_key(4 * j + 2)], d = x[E::vt_key(4 * j + 3)];
                const u32 ab_lo = __byte_perm(a, bb, 0x5140), ab_hi = __byte_perm(a, bb, 0x7362);  // a0 b0 a1 b1, a2 b2 a3 b3
                const u32 cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
                w[0][j] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
                w[1][j] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
                w[2][j] = __byte_perm(ab_hi, cd_hi, 0x5410);
                w[3][j] = __byte_perm(ab_hi, cd_hi, 0x7632);
            }
#pragma unroll
            for (int t = 0; t < 4; ++t)
                *reinterpret_cast<uint4*>(dst + (i64)(rows + t) * keys16 + first) =
                    make_uint4(w[t][0], w[t][1], w[t][2], w[t][3]);
        }
    } else {
        constexpr int kChunks = kKeys / kPerChunk;
        for (int i = threadIdx.x; i < kHeadDim * kChunks; i += 256) {
            const int chunk = (i / 4) % kChunks, row = 4 * (i / (4 * kChunks)) + i % 4, first = key0 + chunk * kPerChunk;
            if (first >= keys16) continue;
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int at = chunk * kPerChunk + j;  // the element's position in the tile
                const int key = at / kGroup * kGroup + E::vt_key(at % kGroup);
                w[j] = tf32_round_bits(*reinterpret_cast<const u32*>(tile + row_of(key) + row * kBytes));
            }
            *reinterpret_cast<uint4*>(dst + ((i64)row * keys16 + first) * kBytes) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// [tf32 qk] q or k for [tf32]: float32 (batch, rows, heads, kHeadDim) at byte strides x_sb, x_ss, x_sh (the last axis
// contiguous) to a C-contiguous copy rounded to TF32 as transpose_v_kernel rounds V (to nearest, ties away): wgmma
// reads float32 operands as TF32 by dropping their low 13 bits, a truncation whose error, twice the rounding's and of
// one sign, a product of rounded operands does not have. Block (256 float4 of one batch's copy, batch), 256 threads.
// The 16 bytes i (counted C-contiguously) of batch b of a (batch, rows, heads, kHeadDim) float32 tensor at byte strides
// x_sb, x_ss, x_sh, the last axis contiguous (round_tf32_kernel's, absmax_f32_kernel's and split_f16x2_kernel's loads).
template <int kHeadDim>
__device__ __forceinline__ uint4 f32_vec4(const unsigned char* x, i64 i, int b, int heads, i64 x_sb, i64 x_ss,
                                          i64 x_sh) {
    constexpr int kVec = kHeadDim / 4;
    const int c = (int)(i % kVec), h = (int)(i / kVec % heads);
    const i64 r = i / kVec / heads;
    return *reinterpret_cast<const uint4*>(x + b * x_sb + r * x_ss + h * x_sh + c * 16);
}

template <int kHeadDim>
__global__ void __launch_bounds__(256) round_tf32_kernel(const unsigned char* __restrict__ x, uint4* __restrict__ y,
                                                         int rows, int heads, i64 x_sb, i64 x_ss, i64 x_sh) {
    const i64 per_batch = (i64)rows * heads * (kHeadDim / 4), i = (i64)blockIdx.x * 256 + threadIdx.x;
    if (i >= per_batch) return;
    const uint4 w = f32_vec4<kHeadDim>(x, i, blockIdx.y, heads, x_sb, x_ss, x_sh);
    y[blockIdx.y * per_batch + i] = make_uint4(tf32_round_bits(w.x), tf32_round_bits(w.y), tf32_round_bits(w.z),
                                               tf32_round_bits(w.w));
}

// [f16x2] The largest magnitude of a float32 tensor (batch, rows, heads, kHeadDim) at byte strides x_sb, x_ss, x_sh
// (the last axis contiguous), its bits atomically maxed into *max_bits (zeroed before; fmaxf passes NaN over). Block
// (256 threads, batch), each thread a float4 at a time, striding over the batch's.
template <int kHeadDim>
__global__ void __launch_bounds__(256) absmax_f32_kernel(const unsigned char* __restrict__ x,
                                                        u32* __restrict__ max_bits, int rows, int heads, i64 x_sb,
                                                        i64 x_ss, i64 x_sh) {
    const i64 per_batch = (i64)rows * heads * (kHeadDim / 4);
    float mx = 0.f;
    for (i64 i = (i64)blockIdx.x * 256 + threadIdx.x; i < per_batch; i += (i64)gridDim.x * 256) {
        const uint4 w = f32_vec4<kHeadDim>(x, i, blockIdx.y, heads, x_sb, x_ss, x_sh);
        mx = fmaxf(mx, fmaxf(fmaxf(fabsf(__uint_as_float(w.x)), fabsf(__uint_as_float(w.y))),
                             fmaxf(fabsf(__uint_as_float(w.z)), fabsf(__uint_as_float(w.w)))));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if ((threadIdx.x & 31) == 0) atomicMax(max_bits, __float_as_uint(mx));
}

// [f16x2] x (as absmax_f32_kernel reads it) times 2^e (f16x2_exponent of *max_bits, exact) split into fp16 parts: hi,
// the product rounded to fp16, and lo, (product - hi) * lo_scale rounded (2^11 for q and k, whose cross products S
// takes in an accumulator of their own; 1 for v), into the C-contiguous (batch, rows, heads, 2 kHeadDim) fp16 array y:
// each row's kHeadDim high parts, then its low parts. Block (256 float4 of one batch, batch).
template <int kHeadDim>
__global__ void __launch_bounds__(256) split_f16x2_kernel(const unsigned char* __restrict__ x, uint2* __restrict__ y,
                                                         const u32* __restrict__ max_bits, float lo_scale, int rows,
                                                         int heads, i64 x_sb, i64 x_ss, i64 x_sh) {
    constexpr int kVec = kHeadDim / 4;
    const i64 per_batch = (i64)rows * heads * kVec, i = (i64)blockIdx.x * 256 + threadIdx.x;
    if (i >= per_batch) return;
    const int c = (int)(i % kVec);
    const uint4 w = f32_vec4<kHeadDim>(x, i, blockIdx.y, heads, x_sb, x_ss, x_sh);
    const float scale = pow2f(f16x2_exponent(*max_bits));
    const float a[4] = {__uint_as_float(w.x) * scale, __uint_as_float(w.y) * scale, __uint_as_float(w.z) * scale,
                        __uint_as_float(w.w) * scale};
    u32 hi[2], lo[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        hi[t] = Elem<fp16>::pack(a[2 * t], a[2 * t + 1]);
        lo[t] = Elem<fp16>::pack((a[2 * t] - Elem<fp16>::to_float(u16(hi[t] & 0xffffu))) * lo_scale,
                                 (a[2 * t + 1] - Elem<fp16>::to_float(u16(hi[t] >> 16))) * lo_scale);
    }
    uint2* row = y + 2 * ((i64)blockIdx.y * per_batch + i - c);  // (a row: kVec chunks of 4 high parts, then low)
    row[c] = make_uint2(hi[0], hi[1]);
    row[kVec + c] = make_uint2(lo[0], lo[1]);
}

// ... and the V^T entry point ([fp8]: T = e4m3, [tf32]: T = tf32, [f16x2]: T = f16x2, whose v_map is V's pairs and
// descale the largest magnitudes' bits; the TMA tiles; v_map V^T's; descale q's, k's and v's
// factors (e4m3) or null).
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90Config<kHeadDim, kBlockM, kBlockN, kNWarps>::kMinBlocks))
flash_fwd_sm90_vt_kernel(CUFLASH_FWD_PARAMS(u16), const float* __restrict__ descale, const VariantParams vp,
                         const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                         const __grid_constant__ TensorMap v_map) {
    flash_fwd_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, true>(CUFLASH_FWD_ARGS, vp,
                                                                             FwdMaps{&q_map, &k_map, &v_map}, descale);
}

}  // namespace cuflash
