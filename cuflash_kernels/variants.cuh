// cuflash attention variants: what changes which scores a kernel computes and how, kept apart from the
// kernel bodies (the kernels' side of cuflash/_variant.py and cuflash/_blocks.py; math in docs/variants.md).
//
// A variant is a policy type, `Variant<...>`, passed to every FlashAttention-2 kernel as its `class V`
// template argument, plus one by-value kernel argument, `VariantParams`, with its runtime values. At the
// start of a block the kernel builds a `BlockInfo<V>` for its (batch, head); everything else is a handful of
// inlined hooks on it:
//   - sequences: len_q, len_k, the rows q0 / k0 where the block's sequence starts in packed (varlen)
//     arrays, and wb, the batch index of per-row statistics and float32 workspaces;
//   - loop bounds of both loop orders (key_range, query_range) and whether a tile needs an element mask
//     (needs_mask), the same arithmetic as cuflash/_blocks.py;
//   - [variant mod]  mod(s, i, j): the raw score q.k with softcap, ALiBi and the bias applied, in raw-score
//     units (so every kernel's scale * log2(e) and softmax stay as they are); with softcap it also gives
//     the derivative d mod / d s for [variant grad] (dS is multiplied by it in the backward; the
//     bias's gradient is dS itself, store_dbias). The bias is a policy of its own (BiasArray): its element
//     type (float32, or float16 / bfloat16 read as such), and where a kernel reads it: straight from global
//     memory, or from the tile of the bias that it stages in shared memory with its K/V or Q/dO tiles
//     ([variant bias tile]: load_bias_tile, mod_scores with a BiasTile);
//   - [variant mask] visible(i, j): the key lies inside the sequence's used keys and the band;
//   - [variant dropout] keep(i, j) / dropout_bits: the Philox keep decision of cuflash/_philox.py, one call
//     per 16 scores (i, i + 8) x (j, j + 1, j + 8, j + 9, ..., j + 24, j + 25), an 8-bit quarter-word each:
//     the 16 scores of a 16 x 32 block that one lane holds in the normal mma accumulator layout (the
//     transposed one swaps quarters between lane pairs).
// A dense call is `Variant<false, ..., false>`: every hook folds to the dense code.
// Header-only, free of CUDA toolkit headers; include after cuflash_tiles.cuh.
#pragma once

namespace cuflash {

// The variants' values that are read once per block (Has_bias, Has_dropout): a small device-side struct
// that VariantParams points to (a bigger by-value argument moved ptxas's register allocation of the dense
// kernels). Layout mirrored by cuflash/_cuda/spec.py: EXTRA_PARAMS_DTYPE.
struct ExtraParams {
    const void* bias;   // (batch, heads_q, seqlen_q, seqlen_k) of the policy's BiasArray::Elem, any strides (0 on
    i64 sb, sh, sm;     //   broadcast axes; 16-byte aligned rows where the policy stages it), in elements
    void* dbias;        // its gradient (BiasArray::Grad), where the launcher did not zero it every element written;
    i64 dsb, dsh, dsm;  //   null when not wanted
    u64 dropout_seed;   // Philox key (seed mod 2^32, seed >> 32)
    u64 dropout_offset; // W = b * 2^32 + h + offset
    u32 keep_threshold; // a score is kept iff its 8-bit Philox quarter-word < keep_threshold = floor((1 - p) 2^8)
    float keep_scale;   // 1 / (1 - p)
    ModArrays mods;     // the arrays user mods read (user_mods.cuh)
    // mask_mod's block sparsity for this launch's tiles (cuflash/_mods.py:BlockMap, compacted): for each row
    // tile (a query tile in the forward and dQ passes, a key tile in the dK/dV pass), how many column tiles
    // hold a visible score and which, ascending: count (Bm, Hm, rows), list (Bm, Hm, rows, cols), int32,
    // batch / head strides in rows (0 where the map broadcasts).
    const int* tile_count;
    const int* tile_list;
    i64 tiles_sb, tiles_sh;
    int tile_cols, pad_;
};

// Philox-4x32-10 (cuflash/_philox.py:philox4x32; Salmon et al., SC'11): four uint32 words of a 128-bit
// counter under a 64-bit key.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// The runtime values of a variant (one by-value kernel argument). The launcher builds it as a NumPy
// structured scalar with the same layout (cuflash/_cuda/spec.py: VARIANT_PARAMS_DTYPE).
struct VariantParams {
    const int* cu_seqlens_q;    // (batch + 1,) first row of each packed sequence (Is_varlen)
    const int* cu_seqlens_k;
    const int* seqused_k;       // (batch,) keys used by each sequence (Has_seqused)
    const float* alibi_slopes;  // (batch, heads_q), batch stride alibi_sb elements (Has_alibi)
    i64 alibi_sb;
    int bottom_right;           // the diagonal: query i faces key i + len_k - len_q (1) or key i (0)
    int window_left;            // band edges (Has_left, Has_right): keys [i + off - left, i + off + right]
    int window_right;
    int band_lo, band_hi;       // off - left, off + right of every sequence (padded batches without seqused_k)
    float softcap_a;            // softcap in raw-score units: s -> softcap_b * tanh(softcap_a * s),
    float softcap_b;            //   softcap_a = scale / softcap, softcap_b = softcap / scale
    float inv_scale;            // 1 / softmax_scale: ALiBi slopes and the bias in raw-score units
    int qk_chunks, v_chunks;    // (Pads_head_dim) the arrays' head dims in 8-column chunks, below the kernel's
    const ExtraParams* extra;   // (Has_bias, Has_dropout) in device memory
};

// The forward kernels' common parameters (their element type E): the tensors, the problem's sizes, the strides, the
// scale; then a VariantParams (CUFLASH_BWD_*: the backward's). CUFLASH_VARIANT_FLAT_PARAMS: VariantParams' fields
// as separate parameters, in the struct's order, for the kernels' flat entry points (launchers that pass only
// pointers and scalars: jaxlib's kernel call, cuflash.jax); CUFLASH_VARIANT_FLAT_ARGS rebuilds the struct from them.
#define CUFLASH_FWD_PARAMS(E)                                                                                  \
    const E* __restrict__ q, const E* __restrict__ k, const E* __restrict__ v, E* __restrict__ o,             \
        float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q, int group, i64 q_sb, i64 q_ss,       \
        i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh, i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh,     \
        float scale_log2
#define CUFLASH_FWD_ARGS                                                                                       \
    q, k, v, o, lse, seqlen_q, seqlen_k, heads_q, group, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, \
        o_sb, o_ss, o_sh, scale_log2
// The backward's dK/dV kernels' and dQ kernel's common parameters, as CUFLASH_FWD_PARAMS.
#define CUFLASH_BWD_DKDV_PARAMS                                                                                \
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,                          \
        const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,           \
        float* __restrict__ dq_accum, u16* __restrict__ dk, u16* __restrict__ dv, float* __restrict__ dkv_accum, \
        int seqlen_q, int seqlen_k, int heads_q, int group, int interleave, i64 q_sb, i64 q_ss, i64 q_sh,      \
        i64 k_sb, i64 k_ss, i64 k_sh, i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh,          \
        i64 dk_sb, i64 dk_ss, i64 dk_sh, i64 dv_sb, i64 dv_ss, i64 dv_sh, float scale
#define CUFLASH_BWD_DKDV_ARGS                                                                                  \
    q, k, v, dout, lse, delta, dq_accum, dk, dv, dkv_accum, seqlen_q, seqlen_k, heads_q, group, interleave,   \
        q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh, dk_sb, dk_ss, dk_sh, dv_sb, \
        dv_ss, dv_sh, scale
#define CUFLASH_BWD_DQ_PARAMS                                                                                  \
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,                          \
        const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,           \
        u16* __restrict__ dq, int seqlen_q, int seqlen_k, int heads_q, int group, i64 q_sb, i64 q_ss,          \
        i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh, i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh, \
        i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale
#define CUFLASH_BWD_DQ_ARGS                                                                                    \
    q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, heads_q, group, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,    \
        v_sb, v_ss, v_sh, do_sb, do_ss, do_sh, dq_sb, dq_ss, dq_sh, scale
#define CUFLASH_VARIANT_FLAT_PARAMS                                                                            \
    const int *cu_seqlens_q, const int *cu_seqlens_k, const int *seqused_k, const float *alibi_slopes,         \
        i64 alibi_sb, int bottom_right, int window_left, int window_right, int band_lo, int band_hi,           \
        float softcap_a, float softcap_b, float inv_scale, int qk_chunks, int v_chunks, const ExtraParams *extra
#define CUFLASH_VARIANT_FLAT_ARGS                                                                              \
    VariantParams{cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, alibi_sb, bottom_right, window_left,   \
                  window_right, band_lo, band_hi, softcap_a, softcap_b, inv_scale, qk_chunks, v_chunks, extra}

// [variant mod] The element types of a bias and of its gradient: float (float32), or fp16 / bf16 stored as 16 bits
// and read as such (no float32 copy).
template <class E> struct BiasElem {  // fp16, bf16
    using Storage = u16;
    __device__ __forceinline__ static float to_float(u16 x) { return Elem<E>::to_float(x); }
    __device__ __forceinline__ static u16 from_float(float x) { return static_cast<u16>(Elem<E>::pack(x, 0.f) & 0xffffu); }
};
template <> struct BiasElem<float> {
    using Storage = float;
    __device__ __forceinline__ static float to_float(float x) { return x; }
    __device__ __forceinline__ static float from_float(float x) { return x; }
};

// The bias policy of a Variant: NoBias, or BiasArray<E, kStaged, G>, an additive (batch, heads_q, seqlen_q,
// seqlen_k) bias of element type E whose gradient, when wanted, is written in G (E, or float32 where the front
// door sums it over broadcast axes). kStaged: the kernel copies the bias of each score tile into shared memory with
// cp.async, in the pipeline of its K/V (forward) or Q/dO (backward) tiles, and reads it there ([variant bias tile];
// the launcher stages only rows of 16-byte multiples, 16-byte aligned, in the kernels that implement it: the wgmma
// kernels); otherwise every thread reads its scores' entries from global memory.
struct NoBias {
    static constexpr bool kOn = false;
    static constexpr bool kStaged = false;
    using Elem = float;
    using Grad = float;
};
template <class E, bool kStaged_, class G = E>
struct BiasArray {
    static constexpr bool kOn = true;
    static constexpr bool kStaged = kStaged_;
    using Elem = E;
    using Grad = G;
};

template <bool Has_left_, bool Has_right_, bool Is_varlen_, bool Has_seqused_, bool Has_softcap_, bool Has_alibi_,
          class Bias_, bool Has_dropout_ = false, class Mod_ = NoMod, bool Pads_head_dim_ = false>
struct Variant {
    static constexpr bool Has_left = Has_left_;        // a sliding window's left edge
    static constexpr bool Has_right = Has_right_;      // causal, or a window's right edge
    static constexpr bool Is_varlen = Is_varlen_;      // packed sequences (cu_seqlens)
    static constexpr bool Has_seqused = Has_seqused_;  // per-sequence key counts (key padding)
    static constexpr bool Has_softcap = Has_softcap_;
    static constexpr bool Has_alibi = Has_alibi_;
    using Bias = Bias_;                                // NoBias or BiasArray<...>
    static constexpr bool Has_bias = Bias::kOn;        // an additive bias (and boolean masks, as -inf)
    static constexpr bool Has_dropout = Has_dropout_;
    static constexpr bool Has_band = Has_left || Has_right;
    // [variant head dim] q, k (and v) have fewer columns than the kernel's head dim (multiples of 8): loads read
    // the arrays' columns and zero-fill the rest of each shared-memory row; stores write the arrays' columns.
    static constexpr bool Pads_head_dim = Pads_head_dim_;
    using Mod = Mod_;                                  // user score_mod / mask_mod (user_mods.cuh)
    static constexpr bool Has_user_mod = Mod::Has_score_mod || Mod::Has_mask_mod;
    static constexpr bool Has_mod = Has_softcap || Has_alibi || Has_bias || Has_user_mod;
    static constexpr bool Has_grad = Has_softcap || Mod::Has_score_mod;  // d mod / d s is not 1 everywhere
    static constexpr bool Has_masked_scores = Has_bias || Mod::Has_mask_mod;  // a mod may give -inf
    static constexpr bool Has_block_map = Mod::Has_mask_mod;  // loops visit the tiles the map lists
    // Where the 16-bit kernels apply mask_mod: in mod() when a derivative is kept per score (it must be 0
    // where a score is masked, whatever score_mod gives there), else in mask_block with the band, on the
    // partial tiles only, so that a full tile carries no mask_mod code at all.
    static constexpr bool Mask_mod_in_mod = Mod::Has_mask_mod && Has_grad;
};

using DenseVariant = Variant<false, false, false, false, false, false, NoBias>;
template <bool Is_causal> using CausalVariant = Variant<false, Is_causal, false, false, false, false, NoBias>;

// A block list entry's flag: every score of the tile that the lengths and the band leave visible passes
// mask_mod (block_map.cu), so the tile needs no mask_mod evaluation (FlexAttention's "full" blocks).
constexpr int kFullTile = 1 << 30;

// [variant mask] The tiles one loop visits, in loop order: tiles first, first + 1, ..., first + count - 1 of the
// band range, or with a block map (a mask_mod) the listed ones (first = 0, tile j = list[j] without its flag).
template <class V>
struct TileLoop {
    int first, count;
    const int* list;
    __device__ __forceinline__ int tile(int j) const {
        if constexpr (V::Has_block_map) {
            return list[j] & ~kFullTile;
        } else {
            return first + j;
        }
    }
    // Whether tile j needs mask_mod score by score (a partial tile of the block map; no mask_mod: never).
    __device__ __forceinline__ bool partial(int j) const {
        if constexpr (V::Has_block_map) {
            return !(list[j] & kFullTile);
        } else {
            return false;
        }
    }
    // Whether mask_block applies mask_mod to tile j (a partial tile, Mask_mod_in_mod false).
    __device__ __forceinline__ bool mask_mod_in_mask(int j) const {
        if constexpr (V::Has_block_map && !V::Mask_mod_in_mod) {
            return partial(j);
        } else {
            return false;
        }
    }
};

template <class V>
struct BlockInfo {
    int len_q, len_k;  // this sequence's query rows and used keys
    int q0, k0;        // its first row in q / out / do and in k / v (0 unless Is_varlen)
    int wb;            // batch index of lse, D and the float32 workspaces (0 when Is_varlen: rows are packed)
    int offset;        // query i faces key i + offset
    int hi, lo;        // the band: query i sees keys [i + lo, i + hi] (lo = offset - left, hi = offset + right)
    float slope;       // ALiBi slope in raw-score units (slope / scale)
    float cap_a, cap_b;
    float inv_scale;
    float scale;        // softmax_scale (Has_user_mod: score_mod sees scaled scores)
    using BiasT = typename BiasElem<typename V::Bias::Elem>::Storage;
    using DBiasT = typename BiasElem<typename V::Bias::Grad>::Storage;
    const BiasT* bias;  // this (batch, head)'s bias rows (Has_bias), rows bias_sm apart (a plane of < 2^31
    int bias_sm;        // elements: the launcher checks)
    DBiasT* dbias;      // and its gradient's (null when not wanted)
    int dbias_sm;
    u32 drop_k0, drop_k1, drop_w0, drop_w1;  // [variant dropout] Philox key and counter words 2, 3
    u32 keep_threshold;
    float keep_scale;
    int qk_chunks, v_chunks;    // (Pads_head_dim) the arrays' head dims in 8-column chunks
    int b, h;                   // (Has_user_mod) the sequence and query head, as the user's mods see them
    const ModArrays* mods;
    const ExtraParams* extra;

    // Sequence b of a call over arrays of seqlen_q x seqlen_k rows (total rows when Is_varlen).
    __device__ __forceinline__ BlockInfo(const VariantParams p, int b, int h, int seqlen_q, int seqlen_k) {
        if constexpr (V::Is_varlen) {
            q0 = p.cu_seqlens_q[b];
            k0 = p.cu_seqlens_k[b];
            len_q = p.cu_seqlens_q[b + 1] - q0;
            len_k = p.cu_seqlens_k[b + 1] - k0;
            wb = 0;
        } else {
            q0 = k0 = 0;
            len_q = seqlen_q;
            len_k = seqlen_k;
            wb = b;
        }
        // The used keys of a sequence are all its keys as far as the diagonal goes (flash-attention's seqused_k).
        // [prefill lengths] A negative count marks a sequence whose output is void (chunked prefill's sequences out
        // of range, decode_append_kernel): it reads no key (the key range of a negative len_k is empty) and its rows
        // are NaN (void_rows). (The front door checks a caller's seqused_k values.)
        if constexpr (V::Has_seqused) len_k = p.seqused_k[b];
        offset = p.bottom_right ? len_k - len_q : 0;
        if constexpr (V::Is_varlen || V::Has_seqused) {  // lengths differ between sequences
            lo = offset - p.window_left;
            hi = offset + p.window_right;
        } else {  // the launcher's, straight from the parameter space (no register held across the loop)
            lo = p.band_lo;
            hi = p.band_hi;
        }
        slope = V::Has_alibi ? p.alibi_slopes[b * p.alibi_sb + h] * p.inv_scale : 0.f;
        cap_a = p.softcap_a;
        cap_b = p.softcap_b;
        inv_scale = p.inv_scale;
        if constexpr (V::Mod::Has_score_mod) scale = 1.f / p.inv_scale;  // once per block, not per score
        if constexpr (V::Has_bias) {
            const ExtraParams& bp = *p.extra;
            bias = static_cast<const BiasT*>(bp.bias) + b * bp.sb + h * bp.sh;
            bias_sm = (int)bp.sm;
            dbias = bp.dbias ? static_cast<DBiasT*>(bp.dbias) + b * bp.dsb + h * bp.dsh : nullptr;
            dbias_sm = (int)bp.dsm;
        }
        if constexpr (V::Has_user_mod) {
            this->b = b;
            this->h = h;
            mods = &p.extra->mods;
            extra = p.extra;
        }
        if constexpr (V::Pads_head_dim) {
            qk_chunks = p.qk_chunks;
            v_chunks = p.v_chunks;
        }
        if constexpr (V::Has_dropout) {
            const ExtraParams& ep = *p.extra;
            drop_k0 = (u32)ep.dropout_seed;
            drop_k1 = (u32)(ep.dropout_seed >> 32);
            const u64 w = ((u64)b << 32) + (u64)h + ep.dropout_offset;
            drop_w0 = (u32)w;
            drop_w1 = (u32)(w >> 32);
            keep_threshold = ep.keep_threshold;
            keep_scale = ep.keep_scale;
        }
    }

    // The FA1 float32 kernels' causal-or-dense info (they take causal_offset as an argument).
    __device__ __forceinline__ BlockInfo(int b, int seqlen_q, int seqlen_k, int causal_offset)
        : len_q(seqlen_q), len_k(seqlen_k), q0(0), k0(0), wb(b), offset(causal_offset), hi(causal_offset), lo(0),
          slope(0.f), cap_a(0.f), cap_b(0.f), inv_scale(0.f), scale(0.f), bias(nullptr), bias_sm(0), dbias(nullptr), dbias_sm(0) {
        static_assert(!V::Has_left && !V::Is_varlen && !V::Has_seqused && !V::Has_mod && !V::Has_dropout,
                      "dense or causal only");
    }

    // [variant head dim] The 8-column chunks of q and k rows, and of v, dO and output rows, that the arrays hold:
    // kHeadDim / 8 (a constant) unless Pads_head_dim.
    template <int kHeadDim>
    __device__ __forceinline__ int qk_cols8() const { if constexpr (V::Pads_head_dim) return qk_chunks; else return kHeadDim / 8; }
    template <int kHeadDim>
    __device__ __forceinline__ int v_cols8() const { if constexpr (V::Pads_head_dim) return v_chunks; else return kHeadDim / 8; }

    // [fa2-fwd 6] A row's output scale (num / l; 0 for a row that saw no key) and its lse (0 for none: -inf), NaN
    // for the rows of a void sequence (void_rows).
    __device__ __forceinline__ bool void_rows() const { return V::Has_seqused && len_k < 0; }
    __device__ __forceinline__ float out_scale(float num, float l) const {
        return void_rows() ? CUFLASH_NAN : l > 0.f ? num / l : 0.f;
    }
    __device__ __forceinline__ float row_lse(float lse, float l) const {
        return void_rows() ? CUFLASH_NAN : l > 0.f ? lse : -CUFLASH_INF;
    }

    // A block of a shorter sequence than the grid covers: query tile m0 (packed batches), or key tile n0
    // (packed batches, or keys past seqused_k). Compiled out for the other variants, where the grid is exact.
    __device__ __forceinline__ bool past_queries(int m0) const { return V::Is_varlen && m0 >= len_q; }
    __device__ __forceinline__ bool past_keys(int n0) const { return (V::Is_varlen || V::Has_seqused) && n0 >= len_k; }

    // Row offset of a per-row statistic (lse, D) or float32 workspace row of head h: rows packed
    // (heads, total) when Is_varlen, else (batch, heads, seqlen). seqlen = the arrays' row count.
    __device__ __forceinline__ i64 row_index(int h, int heads, int seqlen, int row) const {
        return ((i64)wb * heads + h) * seqlen + q0 + row;
    }
    __device__ __forceinline__ i64 key_row_index(int h, int heads, int seqlen, int row) const {
        return ((i64)wb * heads + h) * seqlen + k0 + row;
    }

    // cuflash/_blocks.py:key_range: keys [x, y) that some query row of [q_start, q_stop) sees, within
    // [0, len_k]; x >= y means none. q_stop is clipped to len_q by the caller.
    __device__ __forceinline__ int2 key_range(int q_start, int q_stop) const {
        int first = 0, end = len_k;
        if constexpr (V::Has_left) first = min(max(q_start + lo, 0), len_k);
        if constexpr (V::Has_right) end = min(max(q_stop + hi, 0), len_k);
        return make_int2(first, end);
    }
    // cuflash/_blocks.py:query_range: query rows [x, y) that see some key of [k_start, k_stop), within [0, len_q].
    __device__ __forceinline__ int2 query_range(int k_start, int k_stop) const {
        int first = 0, end = len_q;
        if constexpr (V::Has_right) first = min(max(k_start - hi, 0), len_q);
        if constexpr (V::Has_left) end = min(max(k_stop - lo, 0), len_q);
        return make_int2(first, end);
    }
    // The key tiles of kBlockN keys a query tile [m0, m0 + kBlockM) visits: tiles [x, x + y). (With a left
    // edge, a query tile that sees no key visits none, or one wholly masked tile: harmless.)
    template <int kBlockN, int kBlockM>
    __device__ __forceinline__ int2 key_tiles(int m0) const {
        const int2 kr = key_range(m0, min(m0 + kBlockM, len_q));
        const int first = kr.x / kBlockN;
        return make_int2(first, V::Has_left ? max(num_blocks<kBlockN>(kr.y) - first, 0) : num_blocks<kBlockN>(kr.y));
    }
    // The query tiles of kBlockM rows that see a key tile [n0, n0 + kBlockN): tiles [x, y).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ int2 query_tiles(int n0) const {
        const int2 qr = query_range(n0, min(n0 + kBlockN, len_k));
        const int first = qr.x / kBlockM;
        return make_int2(first, qr.y > qr.x ? num_blocks<kBlockM>(qr.y) : first);
    }

    // The key tiles of kBlockN keys that query tile m_block (of kBlockM rows) visits (forward, dQ).
    template <int kBlockN, int kBlockM>
    __device__ __forceinline__ TileLoop<V> key_loop(int m_block) const {
        const int2 kt = key_tiles<kBlockN, kBlockM>(m_block * kBlockM);
        TileLoop<V> loop{kt.x, kt.y, nullptr};
        if constexpr (V::Has_block_map) {
            loop.list = tile_list(m_block, loop.count);
            loop.first = 0;
        }
        return loop;
    }
    // The query tiles of kBlockM rows that visit key tile n_block (of kBlockN keys) (dK/dV).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ TileLoop<V> query_loop(int n_block) const {
        const int2 qt = query_tiles<kBlockM, kBlockN>(n_block * kBlockN);
        TileLoop<V> loop{qt.x, qt.y - qt.x, nullptr};
        if constexpr (V::Has_block_map) {
            loop.list = tile_list(n_block, loop.count);
            loop.first = 0;
        }
        return loop;
    }

    // Where head h's rows of this sequence start in a (batch, seqlen, heads, d) array with those strides
    // (a packed array's batch stride is 0 and its rows start at q0 / k0).
    template <class T>
    __device__ __forceinline__ T* q_rows(T* base, int b, int h, i64 sb, i64 sh, i64 ss) const {
        return base + b * sb + h * sh + (i64)q0 * ss;
    }
    template <class T>
    __device__ __forceinline__ T* k_rows(T* base, int b, int h, i64 sb, i64 sh, i64 ss) const {
        return base + b * sb + h * sh + (i64)k0 * ss;
    }

    // Whether a tile [q_start, q_start + rows) x [k_start, k_start + cols) may hold a score outside the
    // used keys or the band (cuflash/_blocks.py:tile_needs_mask, plus the end of the keys).
    __device__ __forceinline__ bool needs_mask(int q_start, int rows, int k_start, int cols) const {
        bool m = k_start + cols > len_k;
        if constexpr (V::Has_right) m = m || k_start + cols - 1 > q_start + hi;
        if constexpr (V::Has_left) m = m || k_start < q_start + rows - 1 + lo;
        return m;
    }

    // [variant mask] query i sees key j.
    __device__ __forceinline__ bool visible(int i, int j) const {
        bool keep = j < len_k;
        if constexpr (V::Has_right) keep = keep && j <= i + hi;
        if constexpr (V::Has_left) keep = keep && j >= i + lo;
        return keep;
    }

    // [variant mod] the raw score s = q_i . k_j after softcap, ALiBi and the bias, in raw-score units; `grad`
    // gets d mod / d s (the tanh derivative; 1 without softcap) for [variant grad]. kFloat32 (the
    // float32 kernels): tanhf, whose error fits float32's budget, and mask_mod on every score (they read no
    // block lists); else tanh_exp2 (~3e-7 absolute, the 16-bit kernels), in softcap and in a score_mod's tanhf.
    // kWantGrad = false (the forward): a score_mod is evaluated on floats, without its dual-number derivative.
    // with_mask_mod = false: a full tile of the block map (TileLoop::partial), where mask_mod keeps every score
    // (Mask_mod_in_mod variants and the float32 kernels; the others apply mask_mod in mask_block).
    template <bool kFloat32 = false, bool kWantGrad = true>
    __device__ __forceinline__ float mod(float s, int i, int j, float& grad, bool with_mask_mod = true) const {
        return mod_biased<kFloat32, kWantGrad>(s, i, j, grad, with_mask_mod, V::Has_bias ? bias_raw(i, j) : 0.f);
    }
    // The same with bias entry (i, j) given in raw-score units (bias / scale; read from a staged tile: [variant bias
    // tile]).
    template <bool kFloat32 = false, bool kWantGrad = true>
    __device__ __forceinline__ float mod_biased(float s, int i, int j, float& grad, bool with_mask_mod, float bias_ij) const {
        if constexpr (!V::Has_softcap) grad = 1.f;
        if constexpr (V::Has_softcap) {
            const float th = kFloat32 ? tanhf(cap_a * s) : tanh_exp2(cap_a * s);
            s = cap_b * th;
            grad = 1.f - th * th;
        }
        if constexpr (V::Has_alibi) s -= slope * fabsf((float)(i + offset - j));
        if constexpr (V::Has_bias) s += bias_ij;
        // user mods: score_mod last (on the scaled score, FlexAttention's convention), mask_mod as -inf. With a
        // derivative (the backward, the float32 kernels) only inside the sequence: a NaN derivative at a
        // position past it would make 0 * NaN of its zero P; the 16-bit forward masks those scores afterwards
        // (keys) or never stores them (rows), and the user's array reads are clamped, so it skips the test.
        if constexpr (V::Has_user_mod) {
            if (!kWantGrad || (i < len_q && j < len_k)) {
                if constexpr (V::Mod::Has_score_mod) {
                    if constexpr (kWantGrad) {
                        float g;
                        s = apply_score_mod<typename V::Mod, V::Has_bias, !kFloat32>(s, scale, inv_scale, b, h, i, j, *mods, g);
                        grad *= g;
                    } else {
                        s = apply_score_mod<typename V::Mod, V::Has_bias, !kFloat32>(s, scale, inv_scale, b, h, i, j, *mods);
                    }
                }
                if constexpr (V::Mod::Has_mask_mod && (V::Mask_mod_in_mod || kFloat32)) {
                    if (with_mask_mod && !V::Mod::mask(b, h, i, j, *mods)) {
                        s = -CUFLASH_INF;
                        grad = 0.f;
                    }
                }
            }
        }
        return s;
    }
    template <bool kFloat32 = false>
    __device__ __forceinline__ float mod(float s, int i, int j, bool with_mask_mod = true) const {
        float unused;
        return mod<kFloat32, false>(s, i, j, unused, with_mask_mod);
    }

    // [variant mod] bias entry (i, j) from global memory, in raw-score units (rows and keys past the sequence have
    // no bias: they are masked or never stored).
    __device__ __forceinline__ float bias_raw(int i, int j) const {
        if constexpr (V::Has_bias) {
            return i < len_q && j < len_k ? BiasElem<typename V::Bias::Elem>::to_float(bias[i * bias_sm + j]) * inv_scale
                                          : 0.f;
        } else {
            return 0.f;
        }
    }

    // [variant grad] of the bias: dbias[i, j] = dS (the gradient of the biased scaled score), where wanted.
    __device__ __forceinline__ void store_dbias(int i, int j, float ds) const {
        if constexpr (V::Has_bias) {
            if (dbias != nullptr && i < len_q && j < len_k) dbias[i * dbias_sm + j] = BiasElem<typename V::Bias::Grad>::from_float(ds);
        }
    }

    // The backward's exp2 offset of a row, -lse * log2(e): with a bias, a row whose every key is masked by
    // -inf has lse = -inf and scores of -inf, so its offset is -inf too (P = 0, never -inf + inf = NaN).
    __device__ __forceinline__ float neg_lse_log2(float lse) const {
        if constexpr (V::Has_masked_scores) return lse == -CUFLASH_INF ? -CUFLASH_INF : -lse * kLog2e;
        return -lse * kLog2e;
    }

    // [variant mask] block sparsity (Has_block_map): the column tiles of row tile `row` that hold a visible
    // score, ascending, and their number in `count` (the launcher removed the tiles outside the band too).
    __device__ __forceinline__ const int* tile_list(int row, int& count) const {
        const ExtraParams& ep = *extra;
        const i64 r = b * ep.tiles_sb + h * ep.tiles_sh + row;
        count = __ldg(ep.tile_count + r);
        return ep.tile_list + r * ep.tile_cols;
    }

    // [variant dropout] The Philox call of the 16 scores (i0 + 8a, j0 + 8c + h), a, h in {0, 1}, c in {0, 1, 2,
    // 3} (i0 % 16 < 8; j0 % 32 < 8, even): word 2a + (c & 1), its 8-bit quarter 2 (c >> 1) + h (quarter 0: the
    // low byte). Counter (c0, c1, W lo, W hi) with c0 = (i0 >> 4) * 8 + i0 % 8 (the query: a warp's constant in
    // the forward, where the compiler hoists the rounds that see only c0, c2, c3 out of the key loop) and
    // c1 = (j0 >> 5) * 4 + (j0 >> 1) % 4.
    __device__ __forceinline__ uint4 dropout_words(int i0, int j0) const {
        return dropout_call(((u32)i0 >> 4) * 8 + (i0 & 7), ((u32)j0 >> 5) * 4 + ((j0 >> 1) & 3));
    }
    __device__ __forceinline__ uint4 dropout_call(u32 c0, u32 c1) const {
        return philox4x32_10(make_uint4(c0, c1, drop_w0, drop_w1), drop_k0, drop_k1);
    }
    // Whether score (i, j) is kept (one Philox call for one score: the float32 kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = dropout_words(i & ~8, j & ~25);
        const int word = ((i >> 2) & 2) | ((j >> 3) & 1);
        const int quarter = ((j >> 3) & 2) | (j & 1);
        const u32 r = word == 0 ? w.x : word == 1 ? w.y : word == 2 ? w.z : w.w;
        return ((r >> (8 * quarter)) & 0xffu) < keep_threshold;
    }
};

// [variant dropout] Whether quarter q (byte q) of a Philox word is below the keep threshold T (T < 256, the
// kernels run dropout only then), given t24 = T << 24: (x << (24 - 8 q)) < t24, the quarter moved to the top
// byte (the bytes below it cannot change the outcome of a comparison with a multiple of 2^24).
__device__ __forceinline__ bool quarter_kept(u32 x, int q, u32 t24) { return (x << (24 - 8 * q)) < t24; }

// [variant dropout] The keep bits of one lane's scores of kRowTiles 16-row mma tiles (rows row_base + 16 r),
// bits[r], bit 4 nt + e for element e of n8 tile nt (the for_each_score layout; kTransposed: rows are keys).
// A lane holds, of each 16-row x 32-column block, rows (g, g + 8) x columns (2t, 2t + 1) + 8 c, c < 4.
//   Normal layout (rows are queries; kRowTiles = 1): those 16 are exactly one Philox call's 16 quarters, so
//   one call per 16 scores and no shuffle. With kNT % 4 == 0, col_base is a multiple of 32 (every caller's
//   is a multiple of 8 kNT); otherwise (a user's tile of 16 x an odd number of keys) each 16 columns make
//   their own call and use half of it.
//   Transposed (rows are keys): a lane's scores of a 32-key x 16-query block are a quarter of each of two calls
//   (queries 2t and 2t + 1 with + 8, keys of its parity g & 1): lanes g and g ^ 1 (lane ^ 4) each make one
//   of the two and swap the quarters of the other key parity (one shuffle per 32 keep bits). kRowTiles = 2
//   (row_base a multiple of 32: the mma.sync dK/dV kernel's 32 keys per warp) uses every quarter: one call
//   per 16 scores. kRowTiles = 1 (row_base a multiple of 16: the wgmma kernel's 16 keys per warp) uses the
//   half of each call that its 16 keys own (the other warp of the 32 makes the same call): one per 8 scores.
template <bool kTransposed, int kNT, int kRowTiles, class V>
__device__ __forceinline__ void dropout_bits_tiles(u32 (&bits)[kRowTiles][(4 * kNT + 31) / 32], const BlockInfo<V>& bi,
                                                   int row_base, int col_base, int lane) {
    static_assert(kNT % 2 == 0, "whole 16-column blocks");
    static_assert(kTransposed ? (kRowTiles == 1 || kRowTiles == 2) : kRowTiles == 1, "row tiles");
    constexpr int kWords = (4 * kNT + 31) / 32;
    const int g = lane >> 2, t = lane & 3;
    const u32 t24 = bi.keep_threshold << 24;
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
        for (int w = 0; w < kWords; ++w) bits[r][w] = 0u;
    }
    if constexpr (!kTransposed) {
        // The call of query i0 = row_base + g and keys j0 = col_base + 32 nq + 2t (+ 1, + 8, ..., + 25).
        const u32 c0 = ((u32)row_base >> 1) + g;
        if constexpr (kNT % 4 == 0) {
            const u32 c1 = ((u32)col_base >> 3) + t;
#pragma unroll
            for (int nq = 0; nq < kNT / 4; ++nq) {
                const uint4 w4 = bi.dropout_call(c0, c1 + 4 * nq);
                const u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                for (int wd = 0; wd < 4; ++wd) {  // word 2a + c % 2: query + 8a; quarter 2 (c / 2) + h: key + 8c + h
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const int a = wd >> 1, c = (wd & 1) + 2 * (q >> 1), h = q & 1;
                        const int pos = 4 * (4 * nq + c) + 2 * a + h;  // element 2a + h of n8 tile 4 nq + c
                        if (quarter_kept(words[wd], q, t24)) bits[0][pos >> 5] |= 1u << (pos & 31);
                    }
                }
            }
        } else {
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                const int col = col_base + 16 * np;
                const uint4 w4 = bi.dropout_call(c0, ((u32)col >> 5) * 4 + t);
                const u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
                const int sh = 16 * ((col >> 4) & 1);  // this 16-column block's half of each word
#pragma unroll
                for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int pos = 4 * (2 * np + (wd & 1)) + 2 * (wd >> 1) + h;
                        if (((words[wd] >> sh) << (24 - 8 * h)) < t24) bits[0][pos >> 5] |= 1u << (pos & 31);
                    }
                }
            }
        }
    } else {
        // The call of this lane's queries of parity s = g & 1, i0 = col_base + 16 np + 2t + s, and keys j0 =
        // (row_base & ~31) + (g & 6) (+ 1, + 8, ..., + 25); the other parity is lane ^ 4's call. lo / hi: the
        // quarters of even / odd keys (h = 0 / 1), at the element of query parity 0. Counter words as dropout_words.
        const int s = g & 1;
        const u32 c0 = ((u32)col_base >> 1) + 2 * t + s;
        const u32 c1 = (((u32)row_base >> 3) & ~3u) + (g >> 1);
        const int sh = kRowTiles == 2 ? 0 : 16 * ((row_base >> 4) & 1);  // kRowTiles = 1: its 16 keys' half
        u32 lo[kRowTiles][kWords], hi[kRowTiles][kWords];
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
            for (int w = 0; w < kWords; ++w) lo[r][w] = hi[r][w] = 0u;
        }
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            const uint4 w4 = bi.dropout_call(c0 + 8 * np, c1);
            const u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
            for (int wd = 0; wd < 4; ++wd) {  // word 2a + (c & 1): query + 8a, key + 8 (c & 1) (+ 16 r)
                const int pos = 4 * (2 * np + (wd >> 1)) + 2 * (wd & 1);
#pragma unroll
                for (int r = 0; r < kRowTiles; ++r) {  // quarters 2 ch (even key) and 2 ch + 1 (odd key)
                    const u32 x = words[wd];
                    const bool even = kRowTiles == 2 ? quarter_kept(x, 2 * r, t24) : (x << (24 - sh)) < t24;
                    const bool odd = kRowTiles == 2 ? quarter_kept(x, 2 * r + 1, t24) : (x << (16 - sh)) < t24;
                    if (even) lo[r][pos >> 5] |= 1u << (pos & 31);
                    if (odd) hi[r][pos >> 5] |= 1u << (pos & 31);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                // Own: the quarters of this lane's key parity s, at query parity s; sent: the other parity's,
                // which lane ^ 4 (key parity 1 - s) needs at the same query parity s (its 1 - its own).
                const u32 own = s ? hi[r][w] : lo[r][w], send = s ? lo[r][w] : hi[r][w];
                const u32 got = __shfl_xor_sync(0xffffffffu, send, 4);
                bits[r][w] = (own << s) | (got << (1 - s));
            }
        }
    }
}

// The same for one 16-row tile.
template <bool kTransposed, int kNT, class V>
__device__ __forceinline__ void dropout_bits(u32 (&bits)[(4 * kNT + 31) / 32], const BlockInfo<V>& bi, int row_base,
                                             int col_base, int lane) {
    constexpr int kWords = (4 * kNT + 31) / 32;
    u32 tiles[1][kWords];
    dropout_bits_tiles<kTransposed, kNT, 1>(tiles, bi, row_base, col_base, lane);
#pragma unroll
    for (int w = 0; w < kWords; ++w) bits[w] = tiles[0][w];
}

// [variant dropout] Keep bits drawn here, before the next statement: the Hopper kernels draw them while their
// wgmma run, but the compiler would otherwise sink the Philox rounds below the wait, to where bits are used.
template <int kN>
__device__ __forceinline__ void keep_fence(u32 (&bits)[kN]) {
#pragma unroll
    for (int w = 0; w < kN; ++w) asm volatile("" : "+r"(bits[w]) :: "memory");
}

// Whether element e of n8 tile nt is kept.
template <int kNT>
__device__ __forceinline__ bool kept(const u32 (&bits)[(4 * kNT + 31) / 32], int nt, int e) {
    const int bit = 4 * nt + e;
    return (bits[bit >> 5] >> (bit & 31)) & 1u;
}

// [variant dropout] An A fragment of k16 step kk (n8 tiles 2 kk, 2 kk + 1; c_to_a's layout: register r holds
// elements 2 (r & 1) and + 1 of tile 2 kk + (r >> 1)) with its dropped scores zeroed, in 16 bits.
template <int kNT>
__device__ __forceinline__ void dropout_pairs(u32 (&out)[4], const u32 (&a)[4], const u32 (&bits)[(4 * kNT + 31) / 32],
                                              int kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int nt = 2 * kk + (r >> 1), e = 2 * (r & 1);
        u32 x = a[r];
        if (!kept<kNT>(bits, nt, e)) x &= 0xffff0000u;
        if (!kept<kNT>(bits, nt, e + 1)) x &= 0x0000ffffu;
        out[r] = x;
    }
}

// [variant dropout] P := P * keep * scale with keep bits from dropout_bits (scale 1 in the forward, which
// folds 1 / (1 - p) into the output).
template <int kNT>
__device__ __forceinline__ void dropout_apply(float (&s)[kNT][4], const u32 (&bits)[(4 * kNT + 31) / 32], float scale) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = kept<kNT>(bits, nt, e) ? s[nt][e] * scale : 0.f;
    }
}

// [variant dropout] The same, the keep bits drawn here.
template <bool kTransposed, class V, int kNT>
__device__ __forceinline__ void dropout_scores(float (&s)[kNT][4], const BlockInfo<V>& bi, int row_base, int col_base,
                                               int lane, float scale) {
    if constexpr (V::Has_dropout) {
        u32 bits[(4 * kNT + 31) / 32];
        dropout_bits<kTransposed, kNT>(bits, bi, row_base, col_base, lane);
        dropout_apply<kNT>(s, bits, scale);
    }
}

// [variant mod] on raw scores, in place (a no-op for variants without score mods). with_mask_mod: the tile
// loop's partial(j) (false on a full tile of the block map: no mask_mod evaluation). kFloat32: BlockInfo::mod's
// float32 math (the TF32 forward: tanhf, and mask_mod applied here on a partial tile).
template <bool kTransposed, bool kFloat32 = false, class V, int kNT>
__device__ __forceinline__ void mod_scores(float (&s)[kNT][4], const BlockInfo<V>& bi, int row_base, int col_base,
                                           int lane, bool with_mask_mod = true) {
    if constexpr (V::Has_mod) {
        for_each_score<kTransposed>(s, row_base, col_base, lane, [&](float& x, int i, int j, int, int) {
            x = bi.template mod<kFloat32>(x, i, j, with_mask_mod);
        });
    }
}

// [variant mod] with [variant grad]: also keeps d mod / d s (softcap's 1 - tanh^2, in [0, 1]) per element for
// dS, as float16 pairs (element e of n8 tile nt in half e % 2 of grad[nt][e / 2]): half the registers of
// float32, and dS itself is rounded to 16 bits right after.
template <bool kTransposed, class V, int kNT>
__device__ __forceinline__ void mod_scores_grad(float (&s)[kNT][4], u32 (&grad)[kNT][2], const BlockInfo<V>& bi,
                                                int row_base, int col_base, int lane, bool with_mask_mod = true) {
    float g[kNT][4];
    for_each_score<kTransposed>(s, row_base, col_base, lane, [&](float& x, int i, int j, int nt, int e) {
        x = bi.mod(x, i, j, g[nt][e], with_mask_mod);
    });
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        grad[nt][0] = Elem<fp16>::pack(g[nt][0], g[nt][1]);
        grad[nt][1] = Elem<fp16>::pack(g[nt][2], g[nt][3]);
    }
}

// [variant bias tile] The layout of a bias tile staged in shared memory: kRows x kCols entries of kBytes each,
// rows of kCols * kBytes bytes in 16-byte chunks, chunk c of row r stored at chunk c ^ x(r) of its row, so that the
// fragment reads of bias_fragment are conflict-free in both score layouts: 16-bit entries, x(r) = r % 8 (the
// operand tiles' Swizzle: ldmatrix reads one chunk from each of 8 rows); float32 entries, x(r) = 2 ((r / 2) % 4),
// the same for rows 2u and 2u + 1 and for rows 8 apart (a lane's entries of the transposed layout, queries 2t and
// 2t + 1, are one row apart at one chunk offset: one address), distinct for the 4 row pairs a warp reads at once.
template <int kBytes, int kCols>
struct BiasLayout {
    static constexpr int kChunks = kCols * kBytes / 16;  // 16-byte chunks per row
    static_assert(kBytes == 2 || kBytes == 4, "16-bit or float32 entries");
    static_assert(kChunks % 8 == 0, "whole groups of 8 chunks per row (the swizzle stays inside them)");
    __device__ __forceinline__ static int chunk(int r, int c) { return kBytes == 2 ? c ^ (r & 7) : c ^ (((r >> 1) & 3) << 1); }
    // Byte offset of chunk c of row r.
    __device__ __forceinline__ static int offset(int r, int c) { return (r * kChunks + chunk(r, c)) * 16; }
};

// [variant bias tile] The bias of one tile of scores, staged in shared memory by load_bias_tile (BiasLayout): entries
// of queries q0.. x keys k0.. of the bias's element type.
template <class V, int kCols>
struct BiasTile {
    using T = typename BlockInfo<V>::BiasT;
    using Layout = BiasLayout<(int)sizeof(T), kCols>;
    const T* tile;
    int q0, k0;
};

// [variant bias tile] Copy the bias of queries [q0, q0 + kRows) x keys [k0, k0 + kCols) of this (batch, head) into a
// BiasTile's buffer with 16-byte cp.async (the caller commits; consecutive threads take consecutive chunks of a row:
// coalesced reads): rows past the sequence's queries and chunks past the bias's `cols` columns become zeros (the
// launcher stages only biases whose rows are 16-byte aligned and hold a multiple of 16 bytes). Keys past the used
// ones (seqused_k) are read as they are: their scores are masked.
template <class V, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_bias_tile(typename BlockInfo<V>::BiasT* buf, const BlockInfo<V>& bi, int q0, int k0,
                                               int cols, int tid) {
    using T = typename BlockInfo<V>::BiasT;
    using Layout = BiasLayout<(int)sizeof(T), kCols>;
    static_assert(V::Bias::kStaged, "a staged bias policy");
    constexpr int kPer = 16 / (int)sizeof(T);  // entries per chunk
    constexpr int kTotal = kRows * Layout::kChunks;
    const int chunks = min(max((cols - k0) / kPer, 0), Layout::kChunks);
    const T* g = bi.bias + k0;
    const u32 base = smem_u32(buf);
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int i = tid + it * kThreads;
        if (kTotal % kThreads != 0 && i >= kTotal) break;
        const int r = i / Layout::kChunks, c = i % Layout::kChunks;
        const bool valid = q0 + r < bi.len_q && c < chunks;
        cp_async_16(base + Layout::offset(r, c), valid ? g + (i64)(q0 + r) * bi.bias_sm + c * kPer : g, valid);
    }
}

// [variant bias tile] The bias of the 8 scores a lane holds in n8 tiles 2 kk, 2 kk + 1 of a score block (the
// for_each_score layout: b[hn][e] of s[2 kk + hn][e]), read from a staged tile. 16-bit entries: one ldmatrix.x4,
// whose fragment is the mma C layout in the forward's layout (rows = queries) and, transposed (.trans), in the
// backward's (rows = keys, S^T); float32: 64-bit pairs along the keys, or single words.
template <bool kTransposed, class V, int kCols>
__device__ __forceinline__ void bias_fragment(float (&bv)[2][4], const BiasTile<V, kCols>& bt, int row_base, int col_base,
                                              int kk, int lane) {
    using BT = BiasTile<V, kCols>;
    using L = typename BT::Layout;
    using E = BiasElem<typename V::Bias::Elem>;
    const int g = lane >> 2, t = lane & 3;
    if constexpr (sizeof(typename BT::T) == 2) {
        const u32 base = smem_u32(bt.tile);
        u32 a[4];
        if constexpr (kTransposed) {  // row_base: keys (16 of the warp), col_base: queries
            const int r = col_base - bt.q0 + 16 * kk + (lane & 7) + ((lane >> 4) << 3);
            const int c = ((row_base - bt.k0) >> 3) + ((lane >> 3) & 1);
            ldsm_x4_trans(a, base + L::offset(r, c));
        } else {
            const int r = row_base - bt.q0 + (lane & 15);
            const int c = ((col_base - bt.k0) >> 3) + 2 * kk + (lane >> 4);
            ldsm_x4(a, base + L::offset(r, c));
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // a[x]: elements 2 (x % 2), + 1 of n8 tile 2 kk + x / 2
            bv[x >> 1][2 * (x & 1)] = E::to_float(static_cast<u16>(a[x] & 0xffffu));
            bv[x >> 1][2 * (x & 1) + 1] = E::to_float(static_cast<u16>(a[x] >> 16));
        }
    } else {
        const auto at = [&](int r, int c) {  // float (r, c) of the tile: word c % 4 of chunk c / 4
            return reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(bt.tile) + L::offset(r, c >> 2)) +
                   (c & 3);
        };
#pragma unroll
        for (int hn = 0; hn < 2; ++hn) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = row_base + g + 8 * hh;                 // query, or key (transposed)
                const int col = col_base + 8 * (2 * kk + hn) + 2 * t;  // key, or query (transposed)
                if constexpr (kTransposed) {  // queries col, col + 1: rows one apart, the same chunk (BiasLayout)
                    bv[hn][2 * hh] = *at(col - bt.q0, row - bt.k0);
                    bv[hn][2 * hh + 1] = *at(col + 1 - bt.q0, row - bt.k0);
                } else {
                    const float2 p = *reinterpret_cast<const float2*>(at(row - bt.q0, col - bt.k0));
                    bv[hn][2 * hh] = p.x;
                    bv[hn][2 * hh + 1] = p.y;
                }
            }
        }
    }
}

// [variant mod] with the bias from a staged tile ([variant bias tile]): f(score, i, j, nt, e, bias_ij) for every
// score of the block, 16 columns (one bias_fragment) at a time.
template <bool kTransposed, class V, int kNT, int kCols, class F>
__device__ __forceinline__ void for_each_biased_score(float (&s)[kNT][4], const BiasTile<V, kCols>& bt, int row_base,
                                                      int col_base, int lane, F&& f) {
    static_assert(kNT % 2 == 0, "whole 16-column blocks");
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
        float bv[2][4];
        bias_fragment<kTransposed>(bv, bt, row_base, col_base, kk, lane);
#pragma unroll
        for (int hn = 0; hn < 2; ++hn) {
            const int nt = 2 * kk + hn;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row_base + g + 8 * (e >> 1);
                const int col = col_base + nt * 8 + 2 * t + (e & 1);
                if constexpr (kTransposed) {
                    f(s[nt][e], col, row, nt, e, bv[hn][e]);
                } else {
                    f(s[nt][e], row, col, nt, e, bv[hn][e]);
                }
            }
        }
    }
}

// mod_scores and mod_scores_grad with the bias read from a staged tile.
template <bool kTransposed, class V, int kNT, int kCols>
__device__ __forceinline__ void mod_scores(float (&s)[kNT][4], const BlockInfo<V>& bi, int row_base, int col_base,
                                           int lane, bool with_mask_mod, const BiasTile<V, kCols>& bt) {
    for_each_biased_score<kTransposed>(s, bt, row_base, col_base, lane, [&](float& x, int i, int j, int, int, float b) {
        float unused;
        x = bi.template mod_biased<false, false>(x, i, j, unused, with_mask_mod, b * bi.inv_scale);
    });
}
template <bool kTransposed, class V, int kNT, int kCols>
__device__ __forceinline__ void mod_scores_grad(float (&s)[kNT][4], u32 (&grad)[kNT][2], const BlockInfo<V>& bi,
                                                int row_base, int col_base, int lane, bool with_mask_mod,
                                                const BiasTile<V, kCols>& bt) {
    float g[kNT][4];
    for_each_biased_score<kTransposed>(s, bt, row_base, col_base, lane, [&](float& x, int i, int j, int nt, int e, float b) {
        x = bi.template mod_biased<false, true>(x, i, j, g[nt][e], with_mask_mod, b * bi.inv_scale);
    });
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        grad[nt][0] = Elem<fp16>::pack(g[nt][0], g[nt][1]);
        grad[nt][1] = Elem<fp16>::pack(g[nt][2], g[nt][3]);
    }
}

// Element e of the pairs mod_scores_grad kept for n8 tile nt.
template <int kNT>
__device__ __forceinline__ float grad_at(const u32 (&grad)[kNT][2], int nt, int e) {
    const u32 w = grad[nt][e >> 1];
    return Elem<fp16>::to_float(static_cast<u16>(e & 1 ? w >> 16 : w & 0xffffu));
}

// [variant mask] scores that query i may not see := fill; with_mask_mod (TileLoop::mask_mod_in_mask): those
// mask_mod removes too.
template <bool kTransposed, class V, int kNT>
__device__ __forceinline__ void mask_block(float (&s)[kNT][4], const BlockInfo<V>& bi, int row_base, int col_base,
                                           int lane, float fill, bool with_mask_mod = false) {
    if constexpr (V::Mod::Has_mask_mod && !V::Mask_mod_in_mod) {
        if (with_mask_mod) {  // (uniform over the tile) mask_mod on every score, its loads unconditional: the
            // expression reads the arrays through clamped indices, so evaluating it at a score that the band or
            // the lengths hide reads nothing out of bounds; its value there is discarded.
            const ModArrays arrays = *bi.mods;
            for_each_score<kTransposed>(s, row_base, col_base, lane, [&](float& x, int i, int j, int, int) {
                const bool user = V::Mod::mask(bi.b, bi.h, i, j, arrays);
                if (!(bi.visible(i, j) && (i >= bi.len_q || user))) x = fill;
            });
            return;
        }
    }
    for_each_score<kTransposed>(s, row_base, col_base, lane, [&](float& x, int i, int j, int, int) {
        if (!bi.visible(i, j)) x = fill;
    });
}

}  // namespace cuflash
