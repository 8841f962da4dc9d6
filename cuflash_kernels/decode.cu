// cuflash decode kernels (KV-cache attention, split-KV), mirroring cuflash/reference_decode.py:forward_kvcache.
//
// One decode call is one launch (two where the append is not fused) on one stream, reading one DecodeParams (by
// value; the launcher, cuflash/_cuda/decode.py:DecodeLaunch, fills it once per planned shape and rewrites only its
// pointers per step):
//
// [decode append] fused (fuse_new): the split kernel reads the new tokens' keys and values from k_new / v_new
// (NewRows) and block (key/value head, row tile 0, split 0) of each sequence writes them into their cache slots
// (append_head); no block reads those slots from the cache in that launch.
// decode_append_kernel [decode append] otherwise: one block per new token (b, i), its threads over (key/value
// head, column), writes k and v into slot cache_seqlens[b] + i of both caches before the attention reads them.
// Chunked prefill (a call of many query tokens over a contiguous cache) is that kernel, writing each sequence's key
// count too ([prefill lengths]; -1 for a sequence out of range), then the FlashAttention-2 forward over the cache
// with those counts (seqused_k), whose rows of a negative count are NaN ([decode guard]: variants.cuh, void_rows).
//
// The split kernel, one thread block per (key/value head x packed-row tile, split, sequence). GQA packing
// [decode pack]: the rows of a block are packed rows r = t * group + g (query token t, query head
// h_kv * group + g), so every query head that reads a key/value head is computed from one load of each K/V
// tile. [decode split]: the block walks its part of the sequence's key tiles (cuflash/_blocks.py:split_range
// over the tiles the rows see), loading K and V tiles of kBlockN keys through a cp.async ring of kStages tiles;
// [decode page]: key j of the sequence is cache slot leftpad + j, found through the block table (kPaged) or in
// cache row cache_batch_idx[b]. With one split the block writes the output in the input dtype and lse; else
// its normalized partial O (float32) and lse per row into the workspace, and the last of the splits of its
// rows to finish merges them ([decode merge], merge_tail: no third launch). Two bodies:
//   flash_decode_kernel (head dims 32..128): 16 packed rows; each of the kNWarps warps takes kBlockN / kNWarps
//     keys of every tile and keeps its own online softmax (m, l, O) of the 16 rows, combined through shared
//     memory at the end (the same exact merge as [decode merge]).
//   flash_decode_wide_kernel (head dims 256 and MLA's 576 / 512): kBlockM = 16 x kRowGroups packed rows, and
//     the warps of a row group split the columns of O (an O of 16 rows x 512 columns does not fit one warp's
//     registers): for S each takes kBlockN / kColSplit keys, the row maxima are exchanged through shared
//     memory, and P (16-bit, in shared memory) multiplies each warp's columns of V. With kSharedKV, V is the
//     first kHeadDimV columns of the K tile (MLA: v_cache = k_cache[..., :dv]), loaded once.
//
// decode_merge_kernel [decode merge]: the same merge by itself, one warp per query row (b, h, t)
// (cuflash/_merge.py:merge_stacked; cuflash._cuda.decode.merge_partials).
//
// [decode guard] Index values that live on the device (cache_seqlens, cache_leftpad, cache_batch_idx, block_table)
// cannot be checked before the launch without a synchronization, so the kernels check them where they read them,
// never touching memory out of bounds for them: a sequence whose cache_seqlens[b] is negative or leaves no room for
// the new tokens (> capacity - seqlen_new), whose cache_leftpad[b] is negative or past cache_seqlens[b], or whose
// cache_batch_idx[b] names no cache row, appends nothing and gets NaN in every output row and lse (a few integer
// compares per block, before any loop: sequence_in_range); a block_table entry that names no page (< 0 or >=
// num_blocks) is neither written by the append nor read by the split kernel (the 16-byte chunks of its slots are
// zeros; one unsigned compare beside the page id's load), and the rows of every block that would have read it
// get NaN (merged: a NaN part makes the row NaN). The reference (cuflash/reference_decode.py) does the same.
//
// Masks and mods of a packed row (query token t of a sequence of len_q tokens, len_k keys): key j is seen iff
// j < len_k, j <= t + len_k - len_q + right (causal: right = 0) and j >= t + len_k - len_q - left; softcap and
// ALiBi (slope of the row's query head) on the raw score as in variants.cuh.
//
// Shared memory (16-bit tiles): flash_decode_kernel Q 16 x d + kStages x (K + V) kBlockN x d, the float32 warp
// states reusing the K/V ring at the end (kNWarps x 16 x (d + 2) floats); flash_decode_wide_kernel Q kBlockM x d
// + 2 stages x (K kBlockN x d + V kBlockN x dv unless kSharedKV) + P kBlockM x kBlockN + 2 x kBlockM x
// kColSplit floats (MLA, 64 rows and 64 keys: 225 KiB). The append and merge kernels use none (the fused merge
// one int).
#include "cuflash_tiles.cuh"

namespace cuflash {

// Runtime values of one decode call, passed by value to each of its kernels (strides in elements). The first
// block is the arrays of one step: DecodeLaunch.run rewrites these pointers and nothing else.
struct DecodeParams {
    const u16* q;                // (batch, seqlen_q, heads_q, d)
    u16* k_cache;                // (rows, capacity, heads_kv, d), or paged (pages, page_size, heads_kv, d)
    u16* v_cache;                // (..., dv); may be a view of k_cache (MLA)
    const u16* k_new;            // (batch, seqlen_new, heads_kv, d), or null (nothing appended)
    const u16* v_new;            // (batch, seqlen_new, heads_kv, dv)
    u16* out;                    // (batch, seqlen_q, heads_q, dv) in the input dtype, at strides o_*
    float* lse;                  // (batch, heads_q, seqlen_q), contiguous
    float* o_part;               // (splits, batch, heads_q, seqlen_q, dv) float32 workspace, or null (one split)
    float* lse_part;             // (splits, batch, heads_q, seqlen_q)
    int* split_count;            // (batch, grid x) finished splits per block column, zero between launches
    int* seqused_k;              // (batch,) keys the forward reads per sequence (chunked prefill), or null
    const int* cache_seqlens;    // (batch,) slots used before this call's append
    const int* cache_leftpad;    // (batch,) first used slot, or null (0)
    const int* cache_batch_idx;  // (batch,) cache row of each sequence, or null (b); contiguous caches only
    const int* block_table;      // (batch, max_pages) pages of each sequence (paged)
    const float* alibi_slopes;   // (batch, heads_q), batch stride alibi_sb, or null
    i64 alibi_sb;
    i64 q_sb, q_ss, q_sh;        // q
    i64 k_sb, k_ss, k_sh;        // k_cache
    i64 v_sb, v_ss, v_sh;        // v_cache
    i64 kn_sb, kn_ss, kn_sh;     // k_new
    i64 vn_sb, vn_ss, vn_sh;     // v_new
    i64 o_sb, o_ss, o_sh;        // out
    i64 bt_sb;                   // block_table's batch stride
    int capacity;                // slots a sequence can address: the cache's seqlen, or max_pages * page_size
    int cache_rows;              // axis 0 of the caches: rows (contiguous) or pages (num_blocks, paged)
    int batch, seqlen_q, seqlen_new, heads_q, heads_kv, group, head_dim, head_dim_v, page_size, num_splits, row_tiles;
    int has_left, window_left, has_right, window_right;  // the band (causal: has_right, window_right = 0)
    float scale_log2;            // softmax_scale * log2(e)
    float softcap_a, softcap_b;  // softcap in raw-score units (0: none): s -> b tanh(a s)
    float inv_scale;             // 1 / softmax_scale (ALiBi slopes in raw-score units)
    int page_shift;              // log2(page_size) for a power of two, else -1 (a division)
    int fuse_new;                // [decode append] fused: the split kernel appends and reads new keys from k_new
};

// [decode page] A slot's page index: a shift for page sizes that are powers of two, else a division.
__device__ __forceinline__ int page_index(const DecodeParams& p, int slot) {
    return p.page_shift >= 0 ? slot >> p.page_shift : slot / p.page_size;
}

// [decode guard] Whether sequence b's index values are in range: cache_seqlens[b] (seqlen) in [0, capacity -
// seqlen_new], cache_leftpad[b] in [0, seqlen] and, for a contiguous cache, its row in [0, cache_rows). Then every
// slot it reads or writes, [leftpad, seqlen + seqlen_new), lies in [0, capacity): within the block table's row, or
// the cache row (block_table entries are checked where they are read).
template <bool kPaged>
__device__ __forceinline__ bool sequence_in_range(const DecodeParams& p, int seqlen, int leftpad, int cache_row) {
    return seqlen >= 0 && seqlen <= p.capacity - p.seqlen_new && leftpad >= 0 && leftpad <= seqlen
           && (kPaged || static_cast<unsigned>(cache_row) < static_cast<unsigned>(p.cache_rows));
}

// [decode append] new token i of sequence b into slot cache_seqlens[b] + i of both caches, in place; launched
// before flash_decode_kernel on the same stream, so the attention reads the appended keys. One block per (b, i);
// its threads take (key/value head, column) elements. Each thread writes v's element before k's: where v_cache
// is a view of k_cache (MLA: v_cache = k_cache[..., :dv]) an overlapping element is one address written by one
// thread, and k's value stays, as in the reference (v first, then k). Elements are copied as their 16 bits
// (float16 and bfloat16 alike), 8 at a time where the rows are 16-byte aligned. [decode guard] A sequence out of range appends nothing, a slot whose page is out
// of range is not written.
template <bool kPaged>
__global__ void __launch_bounds__(128) decode_append_kernel(const DecodeParams p) {
    launch_dependents();  // [pdl] chunked prefill's forward may start (it waits for this kernel before reading)
    const int per_sequence = max(p.seqlen_new, 1);  // (chunked prefill without new tokens: one block a sequence)
    const int b = blockIdx.x / per_sequence, i = blockIdx.x % per_sequence;
    // (no new tokens: k_new and v_new may be null, and nothing is read from them)
    const u16* ksrc = i < p.seqlen_new ? p.k_new + b * p.kn_sb + (i64)i * p.kn_ss : nullptr;
    const u16* vsrc = i < p.seqlen_new ? p.v_new + b * p.vn_sb + (i64)i * p.vn_ss : nullptr;
    const int width = max(p.head_dim, p.head_dim_v);
    const int per_head = width / 8;
    // The token's 16-byte chunks read before its slot is known (one a thread, where they are that and fit the block:
    // the common layouts), so that their loads overlap the length's instead of following it
    const bool early = i < p.seqlen_new && ((p.head_dim | p.head_dim_v | p.kn_sh | p.vn_sh) & 7) == 0
                       && ((reinterpret_cast<size_t>(ksrc) | reinterpret_cast<size_t>(vsrc)) & 15) == 0
                       && p.heads_kv * per_head <= int(blockDim.x);
    const int eh = threadIdx.x / max(per_head, 1), ec = threadIdx.x % max(per_head, 1) * 8;
    uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
    if (early && eh < p.heads_kv) {
        if (ec < p.head_dim_v) vx = *reinterpret_cast<const uint4*>(vsrc + eh * p.vn_sh + ec);
        if (ec < p.head_dim) kx = *reinterpret_cast<const uint4*>(ksrc + eh * p.kn_sh + ec);
    }
    const int seqlen = p.cache_seqlens[b];
    const int leftpad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    const int cache_row = kPaged ? 0 : (p.cache_batch_idx ? p.cache_batch_idx[b] : b);
    const bool in_range = sequence_in_range<kPaged>(p, seqlen, leftpad, cache_row);
    // [prefill lengths] the forward over the cache that follows reads the sequence's keys with the new ones; a
    // sequence out of range -1: none, and its rows NaN ([decode guard], the forward's void_rows)
    if (p.seqused_k && i == 0 && threadIdx.x == 0) p.seqused_k[b] = in_range ? seqlen + p.seqlen_new : -1;
    if (!in_range || i >= p.seqlen_new) return;
    const int slot = seqlen + i;
    i64 row, pos;  // [decode page] the slot's page (or cache row) and its place in it
    if constexpr (kPaged) {
        const int page = p.block_table[b * p.bt_sb + slot / p.page_size];
        if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.cache_rows)) return;
        row = page;
        pos = slot % p.page_size;
    } else {
        row = cache_row;
        pos = slot;
    }
    u16* kdst = p.k_cache + row * p.k_sb + pos * p.k_ss;
    u16* vdst = p.v_cache + row * p.v_sb + pos * p.v_ss;
    // 16-byte chunks where every row starts at a multiple of 16 bytes (the common layouts), else 16-bit elements
    const bool chunks = ((p.head_dim | p.head_dim_v | p.k_sh | p.v_sh | p.kn_sh | p.vn_sh) & 7) == 0
                        && ((reinterpret_cast<size_t>(kdst) | reinterpret_cast<size_t>(vdst)
                             | reinterpret_cast<size_t>(ksrc) | reinterpret_cast<size_t>(vsrc)) & 15) == 0;
    if (chunks && early) {  // (the chunks read above: v's before k's, as below)
        if (eh < p.heads_kv) {
            if (ec < p.head_dim_v) *reinterpret_cast<uint4*>(vdst + eh * p.v_sh + ec) = vx;
            if (ec < p.head_dim) *reinterpret_cast<uint4*>(kdst + eh * p.k_sh + ec) = kx;
        }
        return;
    }
    if (chunks) {
        for (int e = threadIdx.x; e < p.heads_kv * per_head; e += blockDim.x) {
            const int h = e / per_head, c = e % per_head * 8;
            if (c < p.head_dim_v)
                *reinterpret_cast<uint4*>(vdst + h * p.v_sh + c) = *reinterpret_cast<const uint4*>(vsrc + h * p.vn_sh + c);
            if (c < p.head_dim)
                *reinterpret_cast<uint4*>(kdst + h * p.k_sh + c) = *reinterpret_cast<const uint4*>(ksrc + h * p.kn_sh + c);
        }
        return;
    }
    for (int e = threadIdx.x; e < p.heads_kv * width; e += blockDim.x) {
        const int h = e / width, c = e % width;
        if (c < p.head_dim_v) vdst[h * p.v_sh + c] = vsrc[h * p.vn_sh + c];
        if (c < p.head_dim) kdst[h * p.k_sh + c] = ksrc[h * p.kn_sh + c];
    }
}

// [decode rotary] Rotary embedding of a decode step's queries and new keys, before the append and the attention
// (cuflash/reference/decode.py: apply_rotary, the reference's step): one block per row (b, t) of q (t < seqlen_q)
// or of k (the new key t - seqlen_q), its threads over (head, column), writing the row into contiguous copies that the
// launch owns (q_rot, k_rot: the arrays the next launches read). Query token t sits at position cache_seqlens[b] + t
// (consecutive_q: causal or a window) or cache_seqlens[b]; new key i at cache_seqlens[b] + i. Each pair (x1, x2) of
// the first 2 * half columns -- (x[2i], x[2i + 1]) interleaved (GPT-J), (x[i], x[i + half]) otherwise (GPT-NeoX) --
// becomes (x1 c - x2 s, x2 c + x1 s) with c, s row `position` of the tables (float32, or q's dtype: kTable), in
// float32 products and sums rounded one by one (no fused multiply-add: the reference's array operations), then
// rounded to the input dtype; the other columns are copied. [decode guard] The tables are read nowhere else: a
// sequence some of whose positions fall outside them (a length below 0, or past seqlen_ro - 1) gets those rows NaN
// (never a read out of bounds) and, in seqlens_out (the lengths the launch's next kernels read), -1: the decode
// kernels' out-of-range sequence, which appends nothing and whose output rows are NaN.
struct RotaryParams {
    const u16* q;              // (batch, seqlen_q, heads_q, d) at strides q_*
    const u16* k_new;          // (batch, seqlen_new, heads_kv, d) at strides kn_*, or null
    const void* cos;           // (seqlen_ro, half) at strides cos_s0, cos_s1
    const void* sin;           // (seqlen_ro, half) at strides sin_s0, sin_s1
    const int* cache_seqlens;  // (batch,)
    u16* q_rot;                // (batch, seqlen_q, heads_q, d), contiguous
    u16* k_rot;                // (batch, seqlen_new, heads_kv, d), contiguous, or null
    int* seqlens_out;          // (batch,): cache_seqlens[b], or -1 where a position falls outside the tables
    i64 q_sb, q_ss, q_sh, kn_sb, kn_ss, kn_sh;  // (elements)
    i64 cos_s0, cos_s1, sin_s0, sin_s1;
    int seqlen_q, seqlen_new, heads_q, heads_kv, head_dim, half, seqlen_ro, interleaved, consecutive_q, pad_;
};

// An entry of a rotary table of C's type: float (float32), or fp16 / bf16 (16-bit words).
template <class C>
__device__ __forceinline__ float rotary_table(const void* table, i64 at) {
    return Elem<C>::to_float(static_cast<const u16*>(table)[at]);
}
template <>
__device__ __forceinline__ float rotary_table<float>(const void* table, i64 at) {
    return static_cast<const float*>(table)[at];
}

template <class T, class C>
__global__ void __launch_bounds__(128) decode_rotary_kernel(const RotaryParams p) {
    const int rows = p.seqlen_q + p.seqlen_new;
    const int b = blockIdx.x / rows, t = blockIdx.x % rows;
    const bool is_q = t < p.seqlen_q;
    const int i = is_q ? t : t - p.seqlen_q;
    const int heads = is_q ? p.heads_q : p.heads_kv, d = p.head_dim, half = p.half;
    const u16* src = is_q ? p.q + b * p.q_sb + (i64)i * p.q_ss : p.k_new + b * p.kn_sb + (i64)i * p.kn_ss;
    const i64 src_sh = is_q ? p.q_sh : p.kn_sh;
    u16* dst = is_q ? p.q_rot + ((i64)b * p.seqlen_q + i) * p.heads_q * d
                    : p.k_rot + ((i64)b * p.seqlen_new + i) * p.heads_kv * d;
    const int seqlen = p.cache_seqlens[b];
    const int position = seqlen + (is_q && !p.consecutive_q ? 0 : i);
    const bool known = position >= 0 && position < p.seqlen_ro;
    if (t == 0 && threadIdx.x == 0) {  // the sequence's last positions: its last query token's and new key's
        const int last = seqlen + max(p.consecutive_q ? p.seqlen_q : 1, p.seqlen_new) - 1;
        p.seqlens_out[b] = seqlen >= 0 && last < p.seqlen_ro ? seqlen : -1;
    }
    for (int e = threadIdx.x; e < heads * d; e += blockDim.x) {
        const int h = e / d, j = e % d;
        const u16* x = src + h * src_sh;
        if (known && j >= 2 * half) {  // (not rotated: its bits)
            dst[e] = x[j];
            continue;
        }
        float r = CUFLASH_NAN;
        if (known) {
            const bool first = p.interleaved ? (j & 1) == 0 : j < half;
            const int pair = p.interleaved ? j >> 1 : (first ? j : j - half);
            const int j1 = p.interleaved ? j & ~1 : pair, j2 = p.interleaved ? j1 + 1 : pair + half;
            const float c = rotary_table<C>(p.cos, position * p.cos_s0 + pair * p.cos_s1);
            const float s = rotary_table<C>(p.sin, position * p.sin_s0 + pair * p.sin_s1);
            const float x1 = Elem<T>::to_float(x[j1]), x2 = Elem<T>::to_float(x[j2]);
            r = first ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)) : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
        }
        dst[e] = static_cast<u16>(Elem<T>::pack(r, 0.f) & 0xffffu);
    }
}

// Loads through L2 only (ld.global.cg): the fused merge reads partials that other blocks of the same launch
// wrote, which an SM's L1 (not coherent between SMs) must not serve.
__device__ __forceinline__ float ld_cg(const float* ptr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
    return v;
}
__device__ __forceinline__ float4 ld_cg4(const float4* ptr) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(ptr));
    return v;
}

// [decode merge] lse = log sum_s exp(lse_s) of one row's parts (lse_of(s) for s < parts), the warp's lanes over the
// parts: the largest part sets the scale (no overflow). Returns (lse, the value the parts' weights subtract: 0 for
// a row that saw no key). A NaN part (fmaxf passes it over) makes the total, the lse and so every weight NaN
// ([decode guard]).
template <class LseOf>
__device__ __forceinline__ float2 merged_lse(LseOf lse_of, int parts, int lane) {
    float top = -CUFLASH_INF;
    for (int s = lane; s < parts; s += 32) top = fmaxf(top, lse_of(s));
    top = warp_max(top);
    const float top_safe = top == -CUFLASH_INF ? 0.f : top;  // a row of only empty parts: exp(-inf - 0) = 0
    float total = 0.f;
    for (int s = lane; s < parts; s += 32) total += expf(lse_of(s) - top_safe);
    total = warp_sum(total);
    const bool seen = total > 0.f;
    const float lse = seen ? top_safe + logf(total) : (total == 0.f ? -CUFLASH_INF : CUFLASH_NAN);
    return make_float2(lse, total == 0.f ? 0.f : lse);
}

// [decode merge] The splits' partial rows of one query row combined exactly (cuflash/_merge.py:merge_stacked):
// lse = top + log sum_s exp(lse_s - top) with top the largest lse_s (0 when every part is empty), then
// o = sum_s exp(lse_s - lse) o_s, written in the input dtype at out's strides, lse in float32. A part with
// lse_s = -inf weighs 0 (every split writes its rows, empty or not); a row whose parts are all empty gets o = 0 and
// lse = -inf; a part
// with lse_s = NaN ([decode guard]) makes the row's o and lse NaN.
// One warp per row (b, h, t) in lse's order; each lane holds kHeadDimV / 128 float4 chunks of the row. The
// partials are read through L2 (ld.global.cg): in the fused merge other blocks of the same launch wrote them.
template <class T, int kHeadDimV>
__device__ __forceinline__ void merge_row(const DecodeParams& p, i64 row, int lane) {
    static_assert(kHeadDimV % 4 == 0, "rows of float4 chunks");
    constexpr int kChunks = kHeadDimV / 4, kPerLane = (kChunks + 31) / 32;
    const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;  // rows of one split
    const int splits = p.num_splits;
    const float* lse_s = p.lse_part + row;  // part s at lse_s[s * rows]

    const float2 merged = merged_lse([&](int s) { return ld_cg(lse_s + s * rows); }, splits, lane);
    const float lse = merged.x, lse_use = merged.y;

    // [decode merge] o = sum_s exp(lse_s - lse) o_s: the weights of parts s0 + lane computed by their lanes, the
    // parts' rows read four at a time (their loads in flight together)
    float4 acc[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += 32) {
        const int n = min(32, splits - s0);
        // 0 for an empty part and a row that saw no key
        const float w_lane = lane < n ? expf(ld_cg(lse_s + (s0 + lane) * rows) - lse_use) : 0.f;
        for (int k0 = 0; k0 < n; k0 += 4) {
            float4 x[4][kPerLane];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int s = s0 + min(k0 + u, n - 1);
                const float4* src = reinterpret_cast<const float4*>(p.o_part + (s * rows + row) * kHeadDimV);
#pragma unroll
                for (int i = 0; i < kPerLane; ++i) {
                    const int c = lane + 32 * i;
                    x[u][i] = (kChunks % 32 == 0 || c < kChunks) ? ld_cg4(src + c) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float w = __shfl_sync(0xffffffffu, w_lane, (k0 + u) & 31);
                if (k0 + u >= n) break;
#pragma unroll
                for (int i = 0; i < kPerLane; ++i) {
                    acc[i].x += w * x[u][i].x;
                    acc[i].y += w * x[u][i].y;
                    acc[i].z += w * x[u][i].z;
                    acc[i].w += w * x[u][i].w;
                }
            }
        }
    }
    const int t = (int)(row % p.seqlen_q), h = (int)(row / p.seqlen_q % p.heads_q), b = (int)(row / p.seqlen_q / p.heads_q);
    u16* dst = p.out + b * p.o_sb + (i64)t * p.o_ss + (i64)h * p.o_sh;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (kChunks % 32 != 0 && c >= kChunks) break;
        // element stores: out= may have any strides with a contiguous last axis (no alignment beyond 2 bytes)
        const u32 lo = Elem<T>::pack(acc[i].x, acc[i].y), hi = Elem<T>::pack(acc[i].z, acc[i].w);
        dst[4 * c] = static_cast<u16>(lo & 0xffffu);
        dst[4 * c + 1] = static_cast<u16>(lo >> 16);
        dst[4 * c + 2] = static_cast<u16>(hi & 0xffffu);
        dst[4 * c + 3] = static_cast<u16>(hi >> 16);
    }
    if (lane == 0) p.lse[row] = lse;
}

// [decode merge] fused into the split kernel: once a block has written its partials, the last of the num_splits
// blocks of its (sequence, block column) to finish merges that column's rows, one warp per row (the threadfence
// reduction of the CUDA programming guide: each block's partials are fenced before it counts itself; the
// counter is set back to 0 by the last block, so that the next launch, or a graph replay, starts from 0).
template <class T, int kHeadDimV, int kRows, int kNWarps>
__device__ __forceinline__ void merge_tail(const DecodeParams& p, int r0, int tid) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* counter = p.split_count + (i64)blockIdx.z * gridDim.x + blockIdx.x;
        const bool last = atomicAdd(counter, 1) == p.num_splits - 1;
        if (last) atomicExch(counter, 0);
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int group = p.group, packed = p.seqlen_q * group, b = blockIdx.z, h_kv = blockIdx.x / p.row_tiles;
    for (int r = tid >> 5; r < kRows && r0 + r < packed; r += kNWarps) {
        const int pr = r0 + r, tq = pr / group, hq = h_kv * group + pr % group;
        merge_row<T, kHeadDimV>(p, ((i64)b * p.heads_q + hq) * p.seqlen_q + tq, tid & 31);
    }
}

// [decode pack] the block's kRows packed rows of q, r0.., into a swizzled tile (rows past the packed ones as zeros).
template <int kRows, int kHeadDim, int kThreads, class Layout = Swizzle<kHeadDim>>
__device__ __forceinline__ void load_packed_q(u16* sQ, const DecodeParams& p, int b, int h_kv, int r0, int packed,
                                              int tid) {
    const int group = p.group;
    for (int i = tid; i < kRows * (kHeadDim / 8); i += kThreads) {
        const int r = i / (kHeadDim / 8), c = i % (kHeadDim / 8);
        const int pr = r0 + r;
        const bool valid = pr < packed;
        const u16* src = valid ? p.q + b * p.q_sb + (i64)(pr / group) * p.q_ss + (i64)(h_kv * group + pr % group) * p.q_sh + c * 8
                               : p.q;
        cp_async_16(smem_u32(sQ + Layout::offset(r, c)), src, valid);
    }
}

// [decode split] The key tiles that packed rows [r0, r0 + kRows) see, and split `split`'s part of them
// (cuflash/_blocks.py:split_range): tiles [part_first, part_end).
template <int kRows, int kBlockN>
__device__ __forceinline__ void split_part(const DecodeParams& p, int r0, int packed, int offset, int len_k, int split,
                                           int& part_first, int& part_end) {
    const int t_first = r0 / p.group, t_last = (min(r0 + kRows, packed) - 1) / p.group;  // the block's query tokens
    int k_first = 0, k_end = len_k;
    if (p.has_left) k_first = min(max(t_first + offset - p.window_left, 0), len_k);
    if (p.has_right) k_end = min(max(t_last + offset + p.window_right + 1, 0), len_k);
    const int tile_first = k_first / kBlockN, tile_end = k_end > k_first ? num_blocks<kBlockN>(k_end) : tile_first;
    const int n_tiles = tile_end - tile_first;
    part_first = tile_first + split * n_tiles / p.num_splits;
    part_end = tile_first + (split + 1) * n_tiles / p.num_splits;
}

// Per lane: the query token and the ALiBi slope (raw-score units) of its rows g and g + 8 of the 16-row tile
// whose first packed row is r0.
__device__ __forceinline__ void packed_rows(const DecodeParams& p, int b, int h_kv, int r0, int packed, int g,
                                            int (&row_t)[2], float (&slope)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int pr = r0 + g + 8 * hh;
        row_t[hh] = pr / p.group;
        slope[hh] = p.alibi_slopes && pr < packed
                        ? p.alibi_slopes[b * p.alibi_sb + h_kv * p.group + pr % p.group] * p.inv_scale : 0.f;
    }
}

// [variant mod], [variant mask] of a score block of the packed rows (kNT n8 tiles of the lane's rows g, g + 8;
// element e of tile nt is key key0 + 8 nt + 2 t4 + e % 2), then the scale for exp2; unseen keys -> -inf.
template <int kNT>
__device__ __forceinline__ void mod_mask_scale(float (&s)[kNT][4], const DecodeParams& p, int key0, const int (&row_t)[2],
                                               const float (&slope)[2], int offset, int len_k, int t4) {
    // A block of the warp that every row sees whole, with no softcap, ALiBi or left window edge (most tiles of a
    // long cache): the scale alone (the same values as below, without their per-score tests)
    const int key_last = key0 + kNT * 8 - 1;
    const bool plain = p.softcap_a == 0.f && slope[0] == 0.f && slope[1] == 0.f && !p.has_left && key_last < len_k
                       && (!p.has_right || key_last <= min(row_t[0], row_t[1]) + offset + p.window_right);
    if (__all_sync(0xffffffffu, plain)) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
        }
        return;
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int hh = e >> 1, key = key0 + nt * 8 + 2 * t4 + (e & 1);
            const int tq = row_t[hh];
            float x = s[nt][e];
            if (p.softcap_a != 0.f) x = p.softcap_b * tanhf(p.softcap_a * x);
            x -= slope[hh] * fabsf((float)(tq + offset - key));
            bool seen = key < len_k;
            if (p.has_right) seen = seen && key <= tq + offset + p.window_right;
            if (p.has_left) seen = seen && key >= tq + offset - p.window_left;
            s[nt][e] = seen ? x * p.scale_log2 : -CUFLASH_INF;
        }
    }
}

template <int kHeadDim, int kBlockN, int kNWarps, int kStages>
struct DecodeConfig {
    static constexpr int kRows = 16;
    static constexpr int kTile = kBlockN * kHeadDim;
    static constexpr int kSmemBytes = 2 * (kRows * kHeadDim + 2 * kStages * kTile);
    static_assert(kStages >= 2, "a ring of at least two tiles");
    static_assert(kNWarps * kRows * (kHeadDim + 2) * 4 <= 2 * 2 * kStages * kTile, "the warp states fit in the K/V ring");
};

// [decode page] The page and the place in it of each cache slot a thread copies for a tile of kBlockN rows of
// kChunks 16-byte chunks (its copies i = tid + it * kThreads, row i / kChunks): read for one tile ahead, so that
// the block-table reads (dependent loads before the copies' addresses) are in flight while the previous tile is
// computed, all of a tile's at once instead of one round trip per row.
template <int kBlockN, int kChunks, int kThreads>
struct PageSlots {
    static constexpr int kIters = (kBlockN * kChunks + kThreads - 1) / kThreads;
    int page[kIters], pos[kIters];

    // The slots of rows [n0, n0 + kBlockN) of the sequence (cache slots slot0 + n0, ...); rows past len_k get
    // page 0 (never read).
    __device__ __forceinline__ void fetch(const DecodeParams& p, const int* pages, int slot0, int n0, int len_k,
                                          int tid) {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int i = tid + it * kThreads, r = i / kChunks;
            const int slot = slot0 + n0 + r;
            const int index = page_index(p, slot);
            const bool used = (kBlockN * kChunks % kThreads == 0 || i < kBlockN * kChunks) && n0 + r < len_k;
            page[it] = used ? __ldg(pages + index) : 0;
            pos[it] = slot - index * p.page_size;
        }
    }
    // The page and place of copy `it` (of cache slot `slot`, fetched above).
    __device__ __forceinline__ void locate(const DecodeParams&, int it, int, int& pg, int& ps) const {
        pg = page[it];
        ps = pos[it];
    }
};

// [decode page] The block table read where each copy needs it (the wide kernel: no registers to hold a tile's).
struct InlinePages {
    const int* pages;
    __device__ __forceinline__ void locate(const DecodeParams& p, int, int slot, int& pg, int& ps) const {
        const int index = page_index(p, slot);
        pg = pages[index];
        ps = slot - index * p.page_size;
    }
};

// [decode append] fused (DecodeParams.fuse_new): the new tokens' rows of K or V, keys [first, len_k) of the
// sequence (slots cache_seqlens[b] + i), read from k_new / v_new (base: the sequence's and head's row 0, ss: the
// token stride) instead of the cache slots that this launch writes; first = len_k when not fused (none).
struct NewRows {
    const u16* base;
    i64 ss;
    int first;
};

// [decode append] fused into the split kernel: block (h_kv, row tile 0, split 0) of an in-range sequence b writes
// head h_kv of its new tokens into slots cache_seqlens[b] + i of both caches, 16 bytes per copy (the caches' and,
// when fused, k_new's and v_new's rows and strides are multiples of 16 bytes). No block of the launch reads those
// slots from the cache (NewRows: they read k_new / v_new), so the write races with nothing; the next launch on the
// stream sees it. [decode guard] as decode_append_kernel: a sequence out of range appends nothing (the caller
// checks), a slot whose page id is out of range is not written (and the blocks that read that key, from k_new,
// set page_fault there, as if they had read the cache: its rows NaN). kSharedKV (MLA, v_cache = k_cache[..., :dv]):
// k's columns alone, which cover v's (the two-launch append writes v, then k over it: the same bits).
template <int kHeadDim, int kHeadDimV, bool kSharedKV, bool kPaged, int kThreads>
__device__ __forceinline__ void append_head(const DecodeParams& p, int b, int h_kv, int seqlen, int cache_row,
                                            int tid) {
    constexpr int kK = kHeadDim / 8, kV = kHeadDimV / 8;
    constexpr int kWidth = kSharedKV ? kK : (kK > kV ? kK : kV);  // 16-byte chunks of a token's row
    const u16* ksrc = p.k_new + b * p.kn_sb + (i64)h_kv * p.kn_sh;
    const u16* vsrc = p.v_new + b * p.vn_sb + (i64)h_kv * p.vn_sh;
    for (int e = tid; e < p.seqlen_new * kWidth; e += kThreads) {
        const int i = e / kWidth, c = e % kWidth;
        const int slot = seqlen + i;
        i64 row, pos;  // [decode page] the slot's page (or cache row) and its place in it
        if constexpr (kPaged) {
            const int index = page_index(p, slot);
            const int page = p.block_table[b * p.bt_sb + index];
            if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.cache_rows)) continue;
            row = page;
            pos = slot - index * p.page_size;
        } else {
            row = cache_row;
            pos = slot;
        }
        if (!kSharedKV && c < kV) {
            *reinterpret_cast<uint4*>(p.v_cache + row * p.v_sb + pos * p.v_ss + (i64)h_kv * p.v_sh + c * 8) =
                *reinterpret_cast<const uint4*>(vsrc + (i64)i * p.vn_ss + c * 8);
        }
        if (c < kK) {
            *reinterpret_cast<uint4*>(p.k_cache + row * p.k_sb + pos * p.k_ss + (i64)h_kv * p.k_sh + c * 8) =
                *reinterpret_cast<const uint4*>(ksrc + (i64)i * p.kn_ss + c * 8);
        }
    }
}

// [decode l2] (an experiment, off: 0) the cache tiles' copies with L2 hints, each read once and streamed: 1 asks the
// L2 to fetch 256 bytes around each 16-byte chunk (.L2::256B: a d-128 key row of 16-bit elements whole), 2 also
// marks the lines evict-first (createpolicy, .L2::cache_hint). For the memory-bound decode (batch 32-64 at 16k-64k
// keys ran 0.95-0.98x cuDNN on the H200, 2026-11-29). To measure: tools/decode_tile_trial.py with and without
// CUFLASH_DEFINES=CUFLASH_DECODE_L2=1 (or 2).
#ifndef CUFLASH_DECODE_L2
#define CUFLASH_DECODE_L2 0
#endif
__device__ __forceinline__ void cp_async_16_cache(u32 dst, const void* src, bool valid) {
#if CUFLASH_DECODE_L2 == 1
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
#elif CUFLASH_DECODE_L2 == 2
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy));
#else
    cp_async_16(dst, src, valid);
#endif
}

// K or V rows [n0, n0 + kBlockN) of the sequence (cache slots leftpad + n0, ...) into a swizzled tile; keys past
// len_k as zeros; keys from fresh.first on from k_new / v_new (fused append). [decode page] Paged: the slots' pages from `slots` (PageSlots::fetch of the same rows).
// [decode guard] A slot whose page id is out of range reads as zeros and sets page_fault. base: the cache with the
// key/value head's offset applied. kUnroll: how many of a thread's 16-byte copies are unrolled (all by default;
// the wide kernel issues its 576-wide tiles with fewer, so that the addresses of the next tile do not compete for
// registers with its O accumulator).
template <int kBlockN, int kHeadDim, int kThreads, bool kPaged, int kUnroll = (kBlockN * kHeadDim / 8 + kThreads - 1) / kThreads,
          class Slots>
__device__ __forceinline__ void load_cache_tile(u16* tile, const u16* base, i64 sb, i64 ss, const DecodeParams& p,
                                                const Slots& slots, int cache_row, int slot0, int n0, int len_k, int tid,
                                                bool& page_fault, const NewRows& fresh) {
    constexpr int kChunks = kHeadDim / 8;
    constexpr int kTotal = kBlockN * kChunks;
#pragma unroll kUnroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int i = tid + it * kThreads;
        if (kTotal % kThreads != 0 && i >= kTotal) break;
        const int r = i / kChunks, c = i % kChunks;
        bool valid = n0 + r < len_k;
        const u16* src = base;
        if constexpr (kPaged) {
            int page = 0, pos = 0;
            if (valid) slots.locate(p, it, slot0 + n0 + r, page, pos);
            if (valid && static_cast<unsigned>(page) >= static_cast<unsigned>(p.cache_rows)) {
                valid = false;
                page_fault = true;
            }
            if (valid) src = base + (i64)page * sb + (i64)pos * ss + c * 8;
        } else {
            if (valid) src = base + (i64)cache_row * sb + (i64)(slot0 + n0 + r) * ss + c * 8;
        }
        // [decode append] fused: a new token's row from k_new / v_new, not from its (not yet written) cache slot
        if (valid && n0 + r >= fresh.first) src = fresh.base + (i64)(n0 + r - fresh.first) * fresh.ss + c * 8;
        cp_async_16_cache(smem_u32(tile + Swizzle<kHeadDim>::offset(r, c)), src, valid);
    }
}

// [decode occupancy] (an experiment, off: 1) the blocks an SM holds of the contiguous-cache kernel, as its launch
// bounds ask: 3 caps it at 168 registers (d 128: 44 bytes of spills; d 32-96 none; the paged kernel keeps 1), so
// three 4-warp blocks fit an SM (70 KiB of shared memory each) instead of two (204-213 registers): batch 64's 512
// blocks in 1.3 waves of 396 instead of 2 of 264, and more loads in flight an SM. H200 2026-11-29: batch 32-64 at
// 16k-64k keys ran 0.95-0.98x cuDNN (tools/decode_tile_trial.py; a third ring stage was slower). To measure:
// decode_tile_trial.py with and without CUFLASH_DEFINES=CUFLASH_DECODE_MIN_BLOCKS=3.
#ifndef CUFLASH_DECODE_MIN_BLOCKS
#define CUFLASH_DECODE_MIN_BLOCKS 1
#endif

template <class T, int kHeadDim, int kBlockN, int kNWarps, int kStages, bool kPaged>
__global__ void __launch_bounds__(kNWarps * 32, kPaged ? 1 : CUFLASH_DECODE_MIN_BLOCKS)
flash_decode_kernel(const DecodeParams p) {
    using Cfg = DecodeConfig<kHeadDim, kBlockN, kNWarps, kStages>;
    constexpr int kRows = Cfg::kRows, kTile = Cfg::kTile, kThreads = kNWarps * 32;
    constexpr int kWN = kBlockN / kNWarps;  // keys of a tile per warp
    static_assert(kWN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
    constexpr int kNT = kWN / 8, kDT = kHeadDim / 8, kKT = kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + kRows * kHeadDim;
    u16* sV = sK + kStages * kTile;

    // grid (heads_kv * row_tiles, splits, batch): x has no 65535 limit (a long chunked prefill has many row tiles)
    const int row_tiles = p.row_tiles;
    const int split = blockIdx.y, b = blockIdx.z;
    const int h_kv = blockIdx.x / row_tiles, rt = blockIdx.x % row_tiles;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int group = p.group, seqlen_q = p.seqlen_q;
    const int packed = seqlen_q * group;  // packed rows of this key/value head
    const int r0 = rt * kRows;            // first packed row of the block

    // [decode guard] a sequence out of range reads no key (len_k 0) and writes NaN rows
    const int seqlen = p.cache_seqlens[b];
    const int leftpad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    const int cache_row = kPaged ? 0 : (p.cache_batch_idx ? p.cache_batch_idx[b] : b);
    const bool in_range = sequence_in_range<kPaged>(p, seqlen, leftpad, cache_row);
    const int len_k = in_range ? seqlen + p.seqlen_new - leftpad : 0;
    const int offset = len_k - seqlen_q;  // query token t faces key t + offset (bottom-right)
    const int* pages = kPaged ? p.block_table + b * p.bt_sb : nullptr;
    bool page_fault = false;  // [decode guard] a page id out of range among the slots this block loaded

    int part_first, part_end;
    split_part<kRows, kBlockN>(p, r0, packed, offset, len_k, split, part_first, part_end);

    const u16* kbase = p.k_cache + (i64)h_kv * p.k_sh;
    const u16* vbase = p.v_cache + (i64)h_kv * p.v_sh;
    // [decode append] fused: keys from seqlen - leftpad on (the new tokens) read from k_new / v_new
    const bool fuse = p.fuse_new != 0;
    const int new_first = fuse ? seqlen - leftpad : len_k;
    const NewRows knew{fuse ? p.k_new + b * p.kn_sb + (i64)h_kv * p.kn_sh : p.k_cache, p.kn_ss, new_first};
    const NewRows vnew{fuse ? p.v_new + b * p.vn_sb + (i64)h_kv * p.vn_sh : p.v_cache, p.vn_ss, new_first};

    load_packed_q<kRows, kHeadDim, kThreads>(sQ, p, b, h_kv, r0, packed, tid);
    PageSlots<kBlockN, kHeadDim / 8, kThreads> slots;  // [decode page] of the next tile to load
    if constexpr (kPaged) {
        if (part_first < part_end) slots.fetch(p, pages, leftpad, part_first * kBlockN, len_k, tid);
    }
    // Tile j goes to stage (j - part_first) % kStages; the first kStages - 1 tiles in flight before the loop (one
    // commit group each, the first with Q), the loop's tile j + kStages - 1 issued before tile j is waited for.
    auto load_tile = [&](int j) {
        const int stage = (j - part_first) % kStages;
        load_cache_tile<kBlockN, kHeadDim, kThreads, kPaged>(sK + stage * kTile, kbase, p.k_sb, p.k_ss, p, slots,
                                                             cache_row, leftpad, j * kBlockN, len_k, tid, page_fault,
                                                             knew);
        load_cache_tile<kBlockN, kHeadDim, kThreads, kPaged>(sV + stage * kTile, vbase, p.v_sb, p.v_ss, p, slots,
                                                             cache_row, leftpad, j * kBlockN, len_k, tid, page_fault,
                                                             vnew);
        if constexpr (kPaged) {  // the pages of the tile after it, in flight while the tiles before it are computed
            if (j + 1 < part_end) slots.fetch(p, pages, leftpad, (j + 1) * kBlockN, len_k, tid);
        }
    };
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
        if (part_first + i < part_end) load_tile(part_first + i);
        if (i + 1 < kStages - 1) cp_async_commit();
    }
    cp_async_commit();
    // [decode append] fused: one block per (sequence, key/value head) writes the new tokens, while the tiles land
    if (fuse && in_range && rt == 0 && split == 0)
        append_head<kHeadDim, kHeadDim, false, kPaged, kThreads>(p, b, h_kv, seqlen, cache_row, tid);

    int row_t[2];
    float slope[2];
    packed_rows(p, b, h_kv, r0, packed, g, row_t, slope);

    float acc[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
    OnlineSoftmax sm;
    sm.init();

    for (int j = part_first; j < part_end; ++j) {
        // the tile kStages - 1 ahead into the stage freed at the end of the last iteration
        if (j + kStages - 1 < part_end) load_tile(j + kStages - 1);
        cp_async_commit();
        cp_async_wait<kStages - 1>();  // Q and tile j have landed
        __syncthreads();
        const int buf = (j - part_first) % kStages;
        const u16* tK = sK + buf * kTile;
        const u16* tV = sV + buf * kTile;

        // [fa2-fwd 2] S = Q K_w^T over this warp's kWN keys of the tile.
        float s[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk) {
            u32 a[4];
            load_a<kHeadDim>(a, sQ, 0, kk, lane);
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                u32 bf[4];
                load_b_nk<kHeadDim>(bf, tK, warp * kWN + np * 16, kk, lane);
                Elem<T>::mma(s[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(s[2 * np + 1], a, bf[2], bf[3]);
            }
        }
        // [variant mod], [variant mask] of the packed rows, then the scale for exp2.
        mod_mask_scale(s, p, j * kBlockN + warp * kWN, row_t, slope, offset, len_k, t4);
        // [fa2-fwd 3], [fa2-fwd 4]
        sm.update(s, acc);
        // [fa2-fwd 5] acc += P V_w
#pragma unroll
        for (int kk = 0; kk < kWN / 16; ++kk) {
            u32 a[4];
            c_to_a<T, kNT>(a, s, kk);
#pragma unroll
            for (int np = 0; np < kDT / 2; ++np) {
                u32 bf[4];
                load_b_kn<kHeadDim>(bf, tV, warp * kWN + kk * 16, np, lane);
                Elem<T>::mma(acc[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(acc[2 * np + 1], a, bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    cp_async_wait<0>();
    // [decode guard] the block's rows NaN when its sequence is out of range or a page it read was
    const bool poisoned = __syncthreads_or(page_fault) != 0 || !in_range;

    // [decode merge] within the block: each warp's (m, l, O) of the 16 rows to shared memory (over the K/V
    // ring), then every thread combines the warps for some (row, column) elements.
    float* sState = reinterpret_cast<float*>(sK);           // kNWarps x 16 x kHeadDim partial O (unnormalized)
    float* sM = sState + kNWarps * kRows * kHeadDim;        // kNWarps x 16 row max (scale * log2(e) units)
    float* sL = sM + kNWarps * kRows;                       // kNWarps x 16 row sum
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = g + 8 * hh;
        const float l = quad_sum(sm.l[hh]);
        if (t4 == 0) {
            sM[warp * kRows + r] = sm.m[hh];
            sL[warp * kRows + r] = l;
        }
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            float* dst = sState + (warp * kRows + r) * kHeadDim + dt * 8 + 2 * t4;
            dst[0] = acc[dt][2 * hh];
            dst[1] = acc[dt][2 * hh + 1];
        }
    }
    __syncthreads();
    for (int i = tid; i < kRows * kHeadDim; i += kThreads) {
        const int r = i / kHeadDim, c = i % kHeadDim;
        const int pr = r0 + r;
        if (pr >= packed) continue;
        float mx = -CUFLASH_INF;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) mx = fmaxf(mx, sM[w * kRows + r]);
        const float m_use = mx == -CUFLASH_INF ? 0.f : mx;
        float l = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < kNWarps; ++w) {
            const float f = exp2f(sM[w * kRows + r] - m_use);
            l += sL[w * kRows + r] * f;
            o += sState[(w * kRows + r) * kHeadDim + c] * f;
        }
        const float val = poisoned ? CUFLASH_NAN : l > 0.f ? o / l : 0.f;
        const float lse = poisoned ? CUFLASH_NAN : l > 0.f ? (m_use + log2f(l)) * kLn2 : -CUFLASH_INF;
        const int tq = pr / group, hq = h_kv * group + pr % group;
        if (p.num_splits == 1) {
            p.out[b * p.o_sb + (i64)tq * p.o_ss + (i64)hq * p.o_sh + c] = static_cast<u16>(Elem<T>::pack(val, 0.f) & 0xffffu);
            if (c == 0) p.lse[((i64)b * p.heads_q + hq) * seqlen_q + tq] = lse;
        } else {
            // partials (splits, batch, heads_q, seqlen_q, d) and (splits, batch, heads_q, seqlen_q)
            const i64 rowi = (((i64)split * p.batch + b) * p.heads_q + hq) * seqlen_q + tq;
            p.o_part[rowi * kHeadDim + c] = val;
            if (c == 0) p.lse_part[rowi] = lse;
        }
    }
    if (p.num_splits > 1) merge_tail<T, kHeadDim, kRows, kNWarps>(p, r0, tid);
}


// What one block of the wide kernels knows of its place: grid (heads_kv x row tiles, splits, batch), its first
// packed row, the sequence's lengths and [decode guard], its split's key tiles [part_first, part_end).
template <int kBlockM, int kBlockN, bool kPaged>
struct WideBlock {
    int split, b, h_kv, rt, r0, packed, seqlen, leftpad, cache_row, len_k, offset, part_first, part_end;
    bool in_range;
    const int* pages;
    __device__ __forceinline__ explicit WideBlock(const DecodeParams& p) {
        split = blockIdx.y;
        b = blockIdx.z;
        h_kv = blockIdx.x / p.row_tiles;
        rt = blockIdx.x % p.row_tiles;
        r0 = rt * kBlockM;  // first packed row of the block
        packed = p.seqlen_q * p.group;
        // [decode guard] a sequence out of range reads no key (len_k 0) and writes NaN rows
        seqlen = p.cache_seqlens[b];
        leftpad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
        cache_row = kPaged ? 0 : (p.cache_batch_idx ? p.cache_batch_idx[b] : b);
        in_range = sequence_in_range<kPaged>(p, seqlen, leftpad, cache_row);
        len_k = in_range ? seqlen + p.seqlen_new - leftpad : 0;
        offset = len_k - p.seqlen_q;
        pages = kPaged ? p.block_table + b * p.bt_sb : nullptr;
        split_part<kBlockM, kBlockN>(p, r0, packed, offset, len_k, split, part_first, part_end);
    }
};

// The maxima of a warp's two rows of scores (g and g + 8 of its 16; kNT n8 tiles), over the quad that holds each.
template <int kNT>
__device__ __forceinline__ void row_max(const float (&s)[kNT][4], float (&mx)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float x = -CUFLASH_INF;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) x = fmaxf(x, fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]));
        mx[hh] = quad_max(x);
    }
}

// [fa2-fwd 3] and [fa2-fwd 4] of the wide kernels for one key tile: this warp's scores s (rows rw + g, rw + g + 8;
// kNT n8 tiles of keys cs * 8 kNT ..) give its row maxima, exchanged with the other kColSplit - 1 column parts
// through sMax (kBlockM x kColSplit floats; a barrier inside), so that every warp rescales by the same new max m;
// then P = exp2(S - m) into sP (the input dtype, as the reference casts P), l (this part's row sums) and acc
// rescaled. The caller synchronizes before reading sP.
template <class T, int kBlockN, int kColSplit, int kNT, int kDT>
__device__ __forceinline__ void exchange_softmax(float (&s)[kNT][4], float (&m)[2], float (&l)[2], float (&acc)[kDT][4],
                                                 float* sMax, u16* sP, int rw, int cs, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
    float part[2];
    row_max(s, part);
    if (t4 == 0) sMax[(rw + g) * kColSplit + cs] = part[0], sMax[(rw + g + 8) * kColSplit + cs] = part[1];
    __syncthreads();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = rw + g + 8 * hh;
        float mx = m[hh];
#pragma unroll
        for (int c = 0; c < kColSplit; ++c) mx = fmaxf(mx, sMax[r * kColSplit + c]);
        // A row that has seen only masked keys keeps m = -inf; exp2(-inf - 0) = 0 and no NaN.
        const float m_use = mx == -CUFLASH_INF ? 0.f : mx;
        const float corr = fast_exp2(m[hh] - m_use);
        m[hh] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const float p0 = fast_exp2(s[nt][2 * hh] - m_use), p1 = fast_exp2(s[nt][2 * hh + 1] - m_use);
            sum += p0 + p1;
            const int col = cs * kNT * 8 + nt * 8 + 2 * t4;
            *reinterpret_cast<u32*>(sP + Swizzle<kBlockN>::offset(r, col / 8) + col % 8) = Elem<T>::pack(p0, p1);
        }
        l[hh] = l[hh] * corr + sum;
        // O rescaled unless no row of the warp has a new max (corr exactly 1: most tiles of a long cache)
        if (__any_sync(0xffffffffu, corr != 1.f)) {
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                acc[dt][2 * hh] *= corr;
                acc[dt][2 * hh + 1] *= corr;
            }
        }
    }
}

// [fa2-fwd 6] of the wide kernels: the row sums of the kColSplit column parts added through shared memory (sSum:
// kBlockM x kColSplit floats), O / l and lse per row, written to out (one split) or to the split's partials, then
// the fused merge ([decode merge]). This thread holds, in acc, columns cs * kDT * 8 + 8 dt + 2 t4 (+ 1) of block
// rows rw + g and rw + g + 8; m and l are its rows' max and its column part's row sums. [decode guard] The block's
// rows are NaN when its sequence is out of range or a page it read was (page_fault of any thread).
template <class T, int kDV, int kBlockM, int kNWarps, int kColSplit, int kDT, class Block>
__device__ __forceinline__ void finish_wide_rows(const DecodeParams& p, const Block& blk, float (&acc)[kDT][4],
                                                 const float (&m)[2], const float (&l)[2], float* sSum,
                                                 bool page_fault, int rw, int cs, int tid) {
    const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    constexpr int kWV = kDT * 8;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float lq = quad_sum(l[hh]);
        if (t4 == 0) sSum[(rw + g + 8 * hh) * kColSplit + cs] = lq;
    }
    const bool poisoned = __syncthreads_or(page_fault) != 0 || !blk.in_range;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = rw + g + 8 * hh, pr = blk.r0 + r;
        if (pr >= blk.packed) continue;
        float lt = 0.f;
#pragma unroll
        for (int c = 0; c < kColSplit; ++c) lt += sSum[r * kColSplit + c];
        const float m_use = m[hh] == -CUFLASH_INF ? 0.f : m[hh];
        const float inv = poisoned ? CUFLASH_NAN : lt > 0.f ? 1.f / lt : 0.f;
        const float lse = poisoned ? CUFLASH_NAN : lt > 0.f ? (m_use + log2f(lt)) * kLn2 : -CUFLASH_INF;
        const int tq = pr / p.group, hq = blk.h_kv * p.group + pr % p.group;
        if (p.num_splits == 1) {
            u16* dst = p.out + blk.b * p.o_sb + (i64)tq * p.o_ss + (i64)hq * p.o_sh + cs * kWV + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                // element stores: out= may have any strides with a contiguous last axis (2-byte alignment)
                const u32 v = Elem<T>::pack(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
                dst[dt * 8] = static_cast<u16>(v & 0xffffu);
                dst[dt * 8 + 1] = static_cast<u16>(v >> 16);
            }
            if (cs == 0 && t4 == 0) p.lse[((i64)blk.b * p.heads_q + hq) * p.seqlen_q + tq] = lse;
        } else {
            const i64 rowi = (((i64)blk.split * p.batch + blk.b) * p.heads_q + hq) * p.seqlen_q + tq;
            float* dst = p.o_part + rowi * kDV + cs * kWV + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
            if (cs == 0 && t4 == 0) p.lse_part[rowi] = lse;
        }
    }
    // (no counters: the launcher merges with decode_merge_kernel, many blocks over the rows; MLA's long rows)
    if (p.num_splits > 1 && p.split_count) merge_tail<T, kDV, kBlockM, kNWarps>(p, blk.r0, tid);
}

// The cache a flash_decode_wide_kernel reads: V's head dim, whether V is the first kHeadDimV columns of the K
// cache (MLA's v_cache = k_cache[..., :dv]: each K tile serves as the V tile, one load for both), paged or not.
template <int kHeadDimV_, bool kSharedKV_, bool kPaged_>
struct DecodeCache {
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr bool kSharedKV = kSharedKV_;
    static constexpr bool kPaged = kPaged_;
};

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Cache>
struct WideDecodeConfig {
    static constexpr int kHeadDimV = Cache::kHeadDimV;
    static constexpr int kRowGroups = kBlockM / 16;            // 16-row mma tiles of packed rows
    static constexpr int kColSplit = kNWarps / kRowGroups;     // warps per row group, splitting keys (S), columns (O)
    static constexpr int kWN = kBlockN / kColSplit;            // keys of S per warp
    static constexpr int kWV = kHeadDimV / kColSplit;          // columns of O per warp
    static constexpr int kTileK = kBlockN * kHeadDim, kTileV = Cache::kSharedKV ? 0 : kBlockN * kHeadDimV;
    static constexpr int kVWidth = Cache::kSharedKV ? kHeadDim : kHeadDimV;  // row length of the tile V is read from
    static constexpr int kSmemBytes = 2 * (kBlockM * kHeadDim + 2 * (kTileK + kTileV) + kBlockM * kBlockN)
                                      + 2 * 4 * kBlockM * kColSplit;
    static_assert(kBlockM % 16 == 0 && kNWarps % kRowGroups == 0, "whole row groups");
    static_assert(kWN % 16 == 0 && kWV % 16 == 0 && kBlockN % 32 == 0, "warp tiles of 16 keys and 16 columns");
    static_assert(kHeadDimV <= kHeadDim || !Cache::kSharedKV, "V within the K tile");
};

// One block of kBlockM packed rows (kRowGroups tiles of 16) over one split's key tiles, for head dims whose O
// does not fit a warp's registers at 16 rows (256; MLA's 576 / 512). Warp w is row group rg = w / kColSplit and
// column part cs = w % kColSplit. Per tile: S of its 16 rows and its kWN keys ([fa2-fwd 2]); the row maxima of
// the kColSplit warps exchanged through shared memory, so that every warp rescales with the same new max
// ([fa2-fwd 3]); P of its keys to shared memory (16-bit, as the reference casts P) and its own partial row
// sums ([fa2-fwd 4]); then O[:, its kWV columns] += P (all kBlockN keys) V ([fa2-fwd 5]). At the end the row
// sums of the column parts are added ([fa2-fwd 6]) and each warp writes its columns.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Cache>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_decode_wide_kernel(const DecodeParams p) {
    using Cfg = WideDecodeConfig<kHeadDim, kBlockM, kBlockN, kNWarps, Cache>;
    constexpr int kDV = Cfg::kHeadDimV, kColSplit = Cfg::kColSplit, kWN = Cfg::kWN, kWV = Cfg::kWV;
    constexpr int kThreads = kNWarps * 32, kTileK = Cfg::kTileK, kTileV = Cfg::kTileV, kVWidth = Cfg::kVWidth;
    constexpr bool kPaged = Cache::kPaged, kSharedKV = Cache::kSharedKV;
    constexpr int kNT = kWN / 8, kDT = kWV / 8, kKT = kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + kBlockM * kHeadDim;
    u16* sV = sK + 2 * kTileK;                                       // (unused with kSharedKV)
    u16* sP = sV + 2 * kTileV;                                       // kBlockM x kBlockN, swizzled
    float* sMax = reinterpret_cast<float*>(sP + kBlockM * kBlockN);  // kBlockM x kColSplit
    float* sSum = sMax + kBlockM * kColSplit;

    const WideBlock<kBlockM, kBlockN, kPaged> blk(p);
    const int b = blk.b, h_kv = blk.h_kv, rt = blk.rt, split = blk.split, r0 = blk.r0, packed = blk.packed;
    const int seqlen = blk.seqlen, leftpad = blk.leftpad, cache_row = blk.cache_row, len_k = blk.len_k;
    const int offset = blk.offset, part_first = blk.part_first, part_end = blk.part_end;
    const bool in_range = blk.in_range;
    const int* pages = blk.pages;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int rg = warp / kColSplit, cs = warp % kColSplit;
    const int rw = rg * 16;               // first row of this warp's row group within the block
    bool page_fault = false;  // [decode guard] a page id out of range among the slots this block loaded

    const u16* kbase = p.k_cache + (i64)h_kv * p.k_sh;
    const u16* vbase = p.v_cache + (i64)h_kv * p.v_sh;
    // [decode append] fused: keys from seqlen - leftpad on (the new tokens) read from k_new / v_new
    const bool fuse = p.fuse_new != 0;
    const int new_first = fuse ? seqlen - leftpad : len_k;
    auto load_tiles = [&](int j, int buf) {
        const InlinePages slots{pages};  // [decode page] (the 576-wide rows leave no registers for a tile's pages)
        const NewRows knew{p.k_new + b * p.kn_sb + (i64)h_kv * p.kn_sh, p.kn_ss, new_first};
        load_cache_tile<kBlockN, kHeadDim, kThreads, kPaged, 1>(sK + buf * kTileK, kbase, p.k_sb, p.k_ss, p, slots,
                                                                cache_row, leftpad, j * kBlockN, len_k, tid,
                                                                page_fault, knew);
        if constexpr (!kSharedKV) {
            const NewRows vnew{p.v_new + b * p.vn_sb + (i64)h_kv * p.vn_sh, p.vn_ss, new_first};
            load_cache_tile<kBlockN, kDV, kThreads, kPaged, 1>(sV + buf * kTileV, vbase, p.v_sb, p.v_ss, p, slots,
                                                            cache_row, leftpad, j * kBlockN, len_k, tid, page_fault,
                                                            vnew);
        }
    };

    load_packed_q<kBlockM, kHeadDim, kThreads>(sQ, p, b, h_kv, r0, packed, tid);
    if (part_first < part_end) load_tiles(part_first, 0);
    cp_async_commit();
    // [decode append] fused: one block per (sequence, key/value head) writes the new tokens, while the tiles land
    if (fuse && in_range && rt == 0 && split == 0)
        append_head<kHeadDim, kDV, kSharedKV, kPaged, kThreads>(p, b, h_kv, seqlen, cache_row, tid);

    int row_t[2];
    float slope[2];
    packed_rows(p, b, h_kv, r0 + rw, packed, g, row_t, slope);

    float acc[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
    float m[2] = {-CUFLASH_INF, -CUFLASH_INF}, l[2] = {0.f, 0.f};  // l: this warp's keys only

    for (int j = part_first; j < part_end; ++j) {
        const int buf = (j - part_first) & 1;
        cp_async_wait<0>();  // Q and tile j have landed
        __syncthreads();     // ... for every thread; and every warp is done with tile j - 1, sP and sMax
        if (j + 1 < part_end) load_tiles(j + 1, buf ^ 1);
        cp_async_commit();
        const u16* tK = sK + buf * kTileK;
        const u16* tV = kSharedKV ? tK : sV + buf * kTileV;

        // [fa2-fwd 2] S = Q_rg K^T over this warp's kWN keys of the tile.
        float s[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < kKT; ++kk) {
            u32 a[4];
            load_a<kHeadDim>(a, sQ, rw, kk, lane);
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                u32 bf[4];
                load_b_nk<kHeadDim>(bf, tK, cs * kWN + np * 16, kk, lane);
                Elem<T>::mma(s[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(s[2 * np + 1], a, bf[2], bf[3]);
            }
        }
        mod_mask_scale(s, p, j * kBlockN + cs * kWN, row_t, slope, offset, len_k, t4);

        exchange_softmax<T, kBlockN, kColSplit>(s, m, l, acc, sMax, sP, rw, cs, lane);
        __syncthreads();  // P of every column part is in sP

        // [fa2-fwd 5] O[:, this warp's columns] += P V
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            u32 a[4];
            load_a<kBlockN>(a, sP, rw, kk, lane);
#pragma unroll
            for (int np = 0; np < kDT / 2; ++np) {
                u32 bf[4];
                load_b_kn<kVWidth>(bf, tV, kk * 16, cs * (kWV / 16) + np, lane);
                Elem<T>::mma(acc[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(acc[2 * np + 1], a, bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();

    finish_wide_rows<T, kDV, kBlockM, kNWarps, kColSplit, kDT>(p, blk, acc, m, l, sSum, page_fault, rw, cs, tid);
}


// [decode merge] by itself: one warp per query row, 4 rows per block (cuflash._cuda.decode.merge_partials; the
// decode launches merge inside the split kernel, merge_tail below).
template <class T, int kHeadDimV>
__global__ void __launch_bounds__(128) decode_merge_kernel(const DecodeParams p) {
    const i64 rows = (i64)p.batch * p.heads_q * p.seqlen_q;
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row < rows) merge_row<T, kHeadDimV>(p, row, threadIdx.x & 31);
}

}  // namespace cuflash

// ---------------------------------------------------------------------------------------------------
// Shared-prefix (cascade) attention on the GPU (cuflash/_cascade.py step for step; cuflash._cuda.cascade): the
// batch's queries, GQA-packed, attend over the prefix chunks in one forward launch, each sequence over its own
// keys in the decode launch, and these two kernels pack the queries before and merge the parts after.
namespace cuflash {

// Runtime values of one cascade call (strides in elements). The workspaces are the launch's; q, out and lse the
// call's.
struct CascadeParams {
    const u16* q;               // (batch, seqlen_q, heads_q, d) at q_s*
    u16* q_rows;                // (rows, heads_kv, d) contiguous: packed row (b, t, g) of key/value head h
    const u16* o_prefix;        // (chunks, rows, heads_kv, dv) contiguous: the prefix chunks' outputs
    const float* lse_prefix;    // (chunks, heads_kv, rows)
    const u16* o_suffix;        // (batch, seqlen_q, heads_q, dv) contiguous: each sequence's own keys
    const float* lse_suffix;    // (batch, heads_q, seqlen_q)
    u16* out;                   // (batch, seqlen_q, heads_q, dv) at o_s*
    float* lse;                 // (batch, heads_q, seqlen_q) contiguous
    i64 q_sb, q_ss, q_sh;
    i64 o_sb, o_ss, o_sh;
    int batch, seqlen_q, heads_q, heads_kv, group, head_dim, head_dim_v, chunks;
};

// [cascade prefix] q in packed rows ([decode pack] order: row (b, t, g) of key/value head h is query head
// h * group + g of token t of sequence b), one block per packed row, 16-byte chunks.
__global__ void __launch_bounds__(128) cascade_pack_kernel(const CascadeParams p) {
    const int r = blockIdx.x;
    const int g = r % p.group, bt = r / p.group, t = bt % p.seqlen_q, b = bt / p.seqlen_q;
    const int chunks = p.head_dim / 8;
    for (int e = threadIdx.x; e < p.heads_kv * chunks; e += blockDim.x) {
        const int h = e / chunks, c = e % chunks;
        const uint4* src = reinterpret_cast<const uint4*>(p.q + b * p.q_sb + t * p.q_ss + (i64)(h * p.group + g) * p.q_sh);
        reinterpret_cast<uint4*>(p.q_rows + ((i64)r * p.heads_kv + h) * p.head_dim)[c] = src[c];
    }
}

// [cascade merge] the chunks + 1 parts of every output row (b, t, query head), merged exactly as [decode merge]
// (cuflash/_merge.py:merge_stacked): one warp per row, 4 rows per block, the parts read in the input dtype.
template <class T, int kHeadDimV>
__global__ void __launch_bounds__(128) cascade_merge_kernel(const CascadeParams p) {
    constexpr int kPairs = kHeadDimV / 2, kPerLane = (kPairs + 31) / 32;
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= (i64)p.batch * p.seqlen_q * p.heads_q) return;
    const int lane = threadIdx.x & 31;
    const int hq = (int)(row % p.heads_q), h = hq / p.group, g = hq % p.group;
    const i64 bt = row / p.heads_q;  // b * seqlen_q + t
    const int t = (int)(bt % p.seqlen_q), b = (int)(bt / p.seqlen_q);
    const i64 rows = (i64)p.batch * p.seqlen_q * p.group, r = bt * p.group + g;  // the packed row
    const int parts = p.chunks + 1;
    const float lse_suffix = p.lse_suffix[((i64)b * p.heads_q + hq) * p.seqlen_q + t];
    auto lse_of = [&](int s) { return s < p.chunks ? p.lse_prefix[((i64)s * p.heads_kv + h) * rows + r] : lse_suffix; };

    // [cascade merge] lse = log sum_s exp(lse_s), as [decode merge]
    const float2 merged = merged_lse(lse_of, parts, lane);
    const float lse = merged.x, lse_use = merged.y;

    // [cascade merge] o = sum_s exp(lse_s - lse) o_s
    float2 acc[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = make_float2(0.f, 0.f);
    for (int s = 0; s < parts; ++s) {
        const float w = expf(lse_of(s) - lse_use);  // 0 for an empty part and a row that saw no key
        if (w == 0.f) continue;
        const u32* src = reinterpret_cast<const u32*>(
            s < p.chunks ? p.o_prefix + (((i64)s * rows + r) * p.heads_kv + h) * kHeadDimV
                         : p.o_suffix + (bt * p.heads_q + hq) * kHeadDimV);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int c = lane + 32 * i;
            if (kPairs % 32 != 0 && c >= kPairs) break;
            const u32 x = src[c];
            acc[i].x += w * Elem<T>::to_float(static_cast<u16>(x & 0xffffu));
            acc[i].y += w * Elem<T>::to_float(static_cast<u16>(x >> 16));
        }
    }
    u16* dst = p.out + b * p.o_sb + t * p.o_ss + hq * p.o_sh;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (kPairs % 32 != 0 && c >= kPairs) break;
        const u32 v = Elem<T>::pack(acc[i].x, acc[i].y);
        dst[2 * c] = static_cast<u16>(v & 0xffffu);
        dst[2 * c + 1] = static_cast<u16>(v >> 16);
    }
    if (lane == 0) p.lse[((i64)b * p.heads_q + hq) * p.seqlen_q + t] = lse;
}

}  // namespace cuflash
