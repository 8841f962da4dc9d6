// cuflash MLA decoding on Hopper (sm_90a): MLA's absorbed decoding (one latent key/value head of 576 = 512 + 64 rope
// dims, V the first 512 columns of the K tile) on the tensor cores' wgmma. decode.cu holds the parameters, the
// guards, the masks and the merge; this file the kernel body (cuflash/_cuda/decode.py launches it for MLA on sm_90).
//
// One block of 64 packed rows (query heads x query tokens, [decode pack]) and two warpgroups walks its split's key
// tiles of 64 keys ([decode split]) two at a time, tile j0 in buffer 0 and j0 + 1 in buffer 1 (72 KiB each, 128-byte
// swizzle, nine column chunks of 64). The warpgroups work out of phase (a "seesaw"): each computes S for one tile of
// the pair, and each holds half of O's 512 columns (128 float32 registers a thread), so that one warpgroup's softmax
// runs while the other's products keep the tensor cores busy:
//   wg 0: [fa2-fwd 2] S0 = Q K0^T (issued at the end of the pair before: [mla early s0]); [fa2-fwd 3] m0 =
//         max(m, rowmax S0) -> shared; [fa2-fwd 4] P0 = exp2(S0 - m0); [fa2-fwd 5] O[:, :256] = O corr0 + P0 V0 (P0
//         from registers); then, with wg 1's m1: P0 exp2(m0 - m1) into shared memory for wg 1, O[:, :256] =
//         O exp2(m0 - m1) + P1 V1 (P1 from shared memory).
//   wg 1: [fa2-fwd 2] S1 = Q K1^T; [fa2-fwd 3] m1 = max(m0, rowmax S1), exp2(m0 - m1) -> shared; [fa2-fwd 4]
//         P1 = exp2(S1 - m1) -> shared; [fa2-fwd 5] O[:, 256:] = O corr1 + P1 V1 + (P0 exp2(m0 - m1)) V0.
// Both end the pair at max m1; each keeps the row sums of its own P (added in finish_wide_rows). P of a tile is
// stored in its buffer's rope chunk (columns 512..575: read by S only). Loads: each column chunk completes on its own
// mbarrier and is issued by the warpgroup that is the chunk's last reader as soon as it is done with it, so that the
// next pair's loads overlap this pair's products; S waits chunk by chunk. kTma: one thread per warpgroup issues
// tensor copies (TMA) of 64 x 64 boxes through the latent cache's CUtensorMap; else cp.async, every thread one key
// row's source (its page, or its k_new row) per tile.
// [fa2-fwd 6], the output, the split partials and the fused merge are flash_decode_wide_kernel's.
#include "decode.cu"
#include "hopper_tiles.cuh"

// [mla early s0] Warpgroup 0 issues the next pair's S0 at the end of a pair, under its own last P V (chunks 0-3 of its
// buffer, which it loaded itself early in the pair) and after it (chunks 4-8), instead of at the top of the next pair
// beside warpgroup 1's S1: the next pair's m0 is then ready when it starts, and warpgroup 0's softmax runs under
// warpgroup 1's S1 (FlashMLA's order for its first warpgroup). 0: both S at the top of each pair.
#ifndef CUFLASH_MLA_EARLY_S0
#define CUFLASH_MLA_EARLY_S0 1
#endif
// [mla p0 first] (an experiment, off: 0) Warpgroup 1 multiplies P0 V0 before P1 V1 in every pair but the split's last,
// so that buffer 0's chunks 4-8 (the next pair's S0 waits for them) are reloaded one product earlier; P1 V1 then waits
// for warpgroup 0's P0 to be in shared memory. H200 2026-11-29 (tools/mla_ab.py, two rounds, q 1, 128 heads): 4096 keys
// 428-434 against 426-432 TFLOP/s per call (noise), 32k 551-563 against 541-549: not enough to switch.
#ifndef CUFLASH_MLA_P0_FIRST
#define CUFLASH_MLA_P0_FIRST 0
#endif

namespace cuflash {

template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// The 128-byte-swizzled layout of a kRows-row tile (hopper_tiles.cuh), as decode.cu's loads take a layout.
template <int kRows>
struct Sw128 {
    __device__ __forceinline__ static int offset(int r, int c) { return sw128_offset<kRows>(r, c); }
};

// [decode page] [decode guard] [decode append] The source row of key `key` of the sequence's latent cache, or null
// (a key past len_k, or a page id out of range: page_fault, a new token's slot too, as if the block had read the
// cache), as decode.cu's load_cache_tile finds it; a new token's row comes from k_new.
template <bool kPaged>
__device__ __forceinline__ const u16* latent_row(const u16* base, const DecodeParams& p, const int* pages,
                                                 int cache_row, int slot0, int key, int len_k, bool& page_fault,
                                                 const NewRows& fresh) {
    if (key >= len_k) return nullptr;
    const u16* src;
    if constexpr (kPaged) {
        const int slot = slot0 + key, index = page_index(p, slot);
        const int page = pages[index];
        if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.cache_rows)) {
            page_fault = true;
            return nullptr;
        }
        src = base + (i64)page * p.k_sb + (i64)(slot - index * p.page_size) * p.k_ss;
    } else {
        src = base + (i64)cache_row * p.k_sb + (i64)(slot0 + key) * p.k_ss;
    }
    return key >= fresh.first ? fresh.base + (i64)(key - fresh.first) * fresh.ss : src;
}

// Column chunks [kC0, kC1) of one key row into a 128-byte-swizzled 64-row tile: the half `half` of each chunk's
// eight 16-byte pieces (a warpgroup's two threads per row, the odd or the even ones), then each chunk's mbarrier told
// (it counts the 128 threads of one warpgroup). A null source fills zeros.
template <int kC0, int kC1>
__device__ __forceinline__ void load_latent_chunks(u32 tile, u32 bars, const u16* src, const u16* any, int r,
                                                   int half) {
    const bool valid = src != nullptr;
    if (!valid) src = any;
#pragma unroll
    for (int c = kC0; c < kC1; ++c) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int piece = 2 * q + half;  // (a row's two threads: one whole 32-byte sector per copy)
            cp_async_16(tile + c * 8192 + r * 128 + ((piece ^ (r & 7)) << 4), src + c * 64 + piece * 8, valid);
        }
        cp_async_mbar_arrive(bars + 8 * c);
    }
}

// Where a key tile comes from. cp.async: this thread's key row (null: zeros); TMA: the tile's page (or contiguous
// cache row) z, not yet checked against the cache's rows, and its first row in it, for the warpgroup's issuing
// thread.
struct TileSource {
    const u16* row;
    int z, first;
};

// Column chunks [kC0, kC1) of a key tile into a 128-byte-swizzled 64-row buffer, each chunk completing on its own
// mbarrier. kTma: one thread of the warpgroup issues the tensor copies (64 x 64 boxes, the map's 128-byte swizzle:
// the buffer's layout), each barrier expecting its 8 KiB (a page id out of range: a plain arrival, the tile's rows
// left as they are, the block's output poisoned by page_fault). Else load_latent_chunks by every thread.
template <bool kTma>
struct ChunkLoader {
    const u16* any;        // (cp.async: the address of a copy of 0 bytes)
    const TensorMap* map;  // (TMA)
    int tw, cache_rows;
    bool& page_fault;

    template <int kC0, int kC1>
    __device__ __forceinline__ void load(u32 tile, u32 bars, const TileSource& src) const {
        if constexpr (kTma) {
            if (tw != 0) return;
            const bool ok = static_cast<unsigned>(src.z) < static_cast<unsigned>(cache_rows);
            page_fault |= !ok;
#pragma unroll
            for (int c = kC0; c < kC1; ++c) {
                if (ok) {
                    mbar_expect_tx(bars + 8 * c, 8192);
                    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                                 "[%1, {%2, %3, %4}], [%5];"
                                 :: "r"(tile + c * 8192), "l"(map), "r"(c * 64), "r"(src.first), "r"(src.z),
                                    "r"(bars + 8 * c)
                                 : "memory");
                } else {
                    mbar_arrive(bars + 8 * c);
                }
            }
        } else {
            load_latent_chunks<kC0, kC1>(tile, bars, src.row, any, tw >> 1, tw & 1);
        }
    }
};

// O and l rescaled by a per-row factor (O only when some row of the warp has a factor other than 1: most tiles of a
// long cache have none).
template <int kDT>
__device__ __forceinline__ void rescale_rows(float (&acc)[kDT][4], float (&l)[2], const float (&f)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        l[hh] *= f[hh];
        if (__any_sync(0xffffffffu, f[hh] != 1.f)) {
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                acc[dt][2 * hh] *= f[hh];
                acc[dt][2 * hh + 1] *= f[hh];
            }
        }
    }
}

// l and O rescaled from max m_old to m, then P = exp2(S - m) in place (m -inf: a row that has seen only masked keys,
// exp2 against 0) with its row sums added to l.
template <int kNT, int kDT>
__device__ __forceinline__ void softmax_rows(float (&s)[kNT][4], const float (&m_old)[2], const float (&m)[2],
                                             float (&l)[2], float (&acc)[kDT][4]) {
    float m_use[2], corr[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        m_use[hh] = m[hh] == -CUFLASH_INF ? 0.f : m[hh];
        corr[hh] = fast_exp2(m_old[hh] - m_use[hh]);
    }
    rescale_rows(acc, l, corr);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) l[hh] += exp_row(s, hh, m_use[hh]);
}

// P (64 x 64, this warp's rows rw + g, rw + g + 8) into a 64 x 64 tile of decode.cu's swizzle, scaled per row.
template <class T, int kNT>
__device__ __forceinline__ void store_p(u16* sP, const float (&s)[kNT][4], const float (&f)[2], int rw, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = rw + g + 8 * hh;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const int col = nt * 8 + 2 * t4;
            *reinterpret_cast<u32*>(sP + Swizzle<64>::offset(r, col / 8) + col % 8) =
                Elem<T>::pack(s[nt][2 * hh] * f[hh], s[nt][2 * hh + 1] * f[hh]);
        }
    }
}

template <class T, bool kPaged, bool kTma = false>
__global__ void __launch_bounds__(256, 1)
flash_decode_mla_sm90_kernel(const DecodeParams p, const __grid_constant__ TensorMap k_map) {
    constexpr int kHeadDim = 576, kDV = 512, kBlockM = 64, kBlockN = 64, kNWarps = 8, kThreads = 256;
    constexpr int kTileK = kBlockN * kHeadDim;  // one buffer: 64 keys x 576 (nine chunks of 8 KiB)
    constexpr int kNT = kBlockN / 8;            // n8 tiles of S
    constexpr int kWV = kDV / 2, kDT = kWV / 8;  // columns of O per warpgroup, its n8 tiles
    constexpr int kPT = kBlockN / 16;            // k16 steps of P V
    constexpr int kRopeChunk = 8;                // the chunk that holds a tile's P once its S is done
    enum { kBarM0 = 1, kBarM1 = 2, kBarP0 = 3 };  // named barriers between the warpgroups (0: __syncthreads)

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);              // 64 x 576, 128-byte swizzle
    u16* sK = sQ + kBlockM * kHeadDim;                        // buffers 0 and 1: 64 x 576, 128-byte swizzle
    float* sM0 = reinterpret_cast<float*>(sK + 2 * kTileK);  // wg 0's m0 per row
    float* sM1 = sM0 + kBlockM;                               // wg 1's m1 per row
    float* sF1 = sM1 + kBlockM;                               // exp2(m0 - m1) per row
    float* sSum = sF1 + kBlockM;                              // 64 x 2 (finish_wide_rows)
    u64* bars = reinterpret_cast<u64*>(sSum + 2 * kBlockM);   // [buffer][chunk] (stride 8 bytes), then Q's

    const WideBlock<kBlockM, kBlockN, kPaged> blk(p);
    const int b = blk.b, h_kv = blk.h_kv, part_first = blk.part_first, part_end = blk.part_end;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2;
    const int wg = warp >> 2;            // warpgroup: tile of the pair, columns of O
    const int rw = (warp & 3) * 16;      // the warp's 16 rows within the block
    const int tw = tid & 127, lr = tw >> 1;  // (cp.async: the key row this thread loads, two threads a row)
    bool page_fault = false;  // [decode guard] a page id out of range among the slots this block loaded

    const u32 bar0 = smem_u32(bars), bar_q = bar0 + 8 * 18;
    auto full = [&](int buf, int c) { return bar0 + 8 * (9 * buf + c); };
    if (tid == 0) {
        for (int i = 0; i < 18; ++i) mbar_init(bar0 + 8 * i, kTma ? 1 : 128);  // (the arrivals of one chunk)
        mbar_init(bar_q, kThreads);
        fence_proxy_async();  // (the initialized barriers visible to the tensor copies' async proxy)
    }
    __syncthreads();

    const u16* kbase = p.k_cache + (i64)h_kv * p.k_sh;
    const bool fuse = p.fuse_new != 0;  // [decode append] fused: new keys read from k_new
    const int new_first = fuse ? blk.seqlen - blk.leftpad : blk.len_k;
    const NewRows knew{p.k_new + b * p.kn_sb + (i64)h_kv * p.kn_sh, p.kn_ss, new_first};
    // [decode page] [decode guard] [decode append] tile j's source (kTma: its first slot is a multiple of 64 in one
    // page, or in the contiguous cache's row: the launcher's condition)
    auto source = [&](int j) -> TileSource {
        if (j >= part_end) return {nullptr, 0, 0};
        if constexpr (kTma) {
            if (tw != 0) return {nullptr, 0, 0};
            const int slot = j * kBlockN;
            if constexpr (kPaged) {
                // (the page id is checked where the copies are issued: its load stays in flight until then)
                const int index = page_index(p, slot);
                return {nullptr, blk.pages[index], slot - index * p.page_size};
            } else {
                return {nullptr, blk.cache_row, slot};
            }
        } else {
            return {latent_row<kPaged>(kbase, p, blk.pages, blk.cache_row, blk.leftpad, j * kBlockN + lr, blk.len_k,
                                       page_fault, knew), 0, 0};
        }
    };
    const ChunkLoader<kTma> loader{kbase, &k_map, tw, p.cache_rows, page_fault};
    // kTma: a sequence's last, partial tile gets V's rows past its last key zeroed in all eight V chunks of its
    // buffer (the tensor copy reads whatever the cache holds there; cp.async fills zeros; P is 0 there, but 0 times
    // a NaN is not 0), by the warpgroup whose S read that buffer, after that S (whose keys there are masked) and
    // before the handover that both warpgroups pass before their P V of it (made a full barrier for that tile)
    auto zero_tail = [&](u32 tile, int j) -> bool {
        if constexpr (kTma) {
            const int valid = blk.len_k - j * kBlockN;
            if (valid < kBlockN) {
                for (int i = tw; i < (kBlockN - valid) * 64; i += 128) {
                    const u32 at = tile + ((i >> 3) & 7) * 8192 + (valid + (i >> 6)) * 128 + ((i & 7) << 4);
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(at), "r"(0) : "memory");
                }
                fence_proxy_async();
                return true;
            }
        }
        return false;
    };
    const u32 q_addr = smem_u32(sQ), k_addr = smem_u32(sK);
    const u32 tile0 = k_addr, tile1 = k_addr + kTileK * 2;

    load_packed_q<kBlockM, kHeadDim, kThreads, Sw128<kBlockM>>(sQ, p, b, h_kv, blk.r0, blk.packed, tid);
    cp_async_mbar_arrive(bar_q);
    // The first pair's tiles, each chunk by the warpgroup that loads it at every later pair (see the loop)
    const TileSource src0 = source(part_first), src1 = source(part_first + 1);
    if (part_first < part_end) {
        if (wg == 0) loader.template load<0, 4>(tile0, full(0, 0), src0);
        else loader.template load<4, 9>(tile0, full(0, 0), src0);
    }
    if (part_first + 1 < part_end) {
        if (wg == 0) {
            loader.template load<0, 4>(tile1, full(1, 0), src1);
            loader.template load<8, 9>(tile1, full(1, 0), src1);
        } else {
            loader.template load<4, 8>(tile1, full(1, 0), src1);
        }
    }
    if (fuse && blk.in_range && blk.rt == 0 && blk.split == 0)
        append_head<kHeadDim, kDV, true, kPaged, kThreads>(p, b, h_kv, blk.seqlen, blk.cache_row, tid);

    int row_t[2];
    float slope[2];
    packed_rows(p, b, h_kv, blk.r0 + rw, blk.packed, g, row_t, slope);

    // Descriptors (hopper_tiles.cuh's layout note): Q and K K-major (each warpgroup's S reads its own buffer), V
    // MN-major from the buffer's column chunks 4 wg .. 4 wg + 3. A descriptor's address field is (address >> 4) in
    // its low 14 bits: below 256 KiB an offset adds to it without carrying out, so each base is built once.
    const u64 desc_q0 = sw128_desc(q_addr, 16, 1024);
    const u64 desc_k0 = sw128_desc(k_addr + wg * kTileK * 2, 16, 1024);
    const u64 desc_v0 = sw128_desc(k_addr + wg * (kWV / 64) * kBlockN * 128, kBlockN * 128, 1024);
    auto desc_q = [&](int kk) { return desc_q0 + (u64)(((kk >> 2) * kBlockM * 128 + (kk & 3) * 32) >> 4); };
    auto desc_k = [&](int kk) { return desc_k0 + (u64)(((kk >> 2) * kBlockN * 128 + (kk & 3) * 32) >> 4); };
    auto desc_v = [&](int buf, int kk) { return desc_v0 + (u64)((buf * kTileK * 2 + kk * 2048) >> 4); };
    u16* const sP0 = sK + kRopeChunk * kBlockN * 64;            // P0 in buffer 0's rope chunk
    u16* const sP1 = sK + kTileK + kRopeChunk * kBlockN * 64;   // P1 in buffer 1's rope chunk

    float acc[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
    float m[2] = {-CUFLASH_INF, -CUFLASH_INF}, l[2] = {0.f, 0.f};  // l: the row sums of this warpgroup's P only
    // [fa2-fwd 5] O[:, this warpgroup's columns] += P V of buffer buf, P as the register operand (committed, not
    // waited for)
    auto issue_pv = [&](const u32 (&a)[kPT][4], int buf) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kPT; ++kk) Wgmma<T>::rs_tb(acc, a[kk], desc_v(buf, kk), 1, Int<kWV>());
        wgmma_commit();
    };

    // A handover to the other warpgroup (it waits at the barrier): an arrival, or a wait too where this warpgroup
    // zeroed a V tail that its own P V reads next (the barrier orders the whole warpgroup's stores before it)
    auto handover = [&](int bar, bool wait) {
        if (wait) named_bar_sync(bar, kThreads);
        else named_bar_arrive(bar, kThreads);
    };

    // [fa2-fwd 2] S = Q K^T of this warpgroup's tile: the chunks at positions [i0, i1) of the order they are loaded
    // in, each once it has landed (barrier phase ph), committed as one group (not waited for). The order: wg 0's
    // buffer-0 chunks 0-3 (by itself, early), then 4-8 (by wg 1, late); wg 1's buffer-1 chunks 4-7 (by itself), then
    // 0-3 and 8 (by wg 0)
    float s[kNT][4];
    auto issue_s = [&](const int i0, const int i1, const int ph) {
#pragma unroll
        for (int i = i0; i < i1; ++i) {
            const int c = wg == 0 ? i : (i < 4 ? i + 4 : i < 8 ? i - 4 : 8);
            mbar_wait(full(wg, c), ph);
            fence_proxy_async();
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < 4; ++q)
                Wgmma<T>::ss(s, desc_q(4 * c + q), desc_k(4 * c + q), i + q > 0, Int<kBlockN>());
        }
        wgmma_commit();
    };
    constexpr bool kEarlyS0 = CUFLASH_MLA_EARLY_S0 != 0;  // [mla early s0]

    mbar_wait(bar_q, 0);
    fence_proxy_async();
    if (kEarlyS0 && wg == 0 && part_first < part_end) {  // (the first pair's S0)
        issue_s(0, 9, 0);
        wgmma_wait<0>();
    }
    // One pair of tiles, j0 and j0 + 1 (kLast: the split's last pair, whose second tile may be missing; [mla early s0]
    // issues no next S0 there: the other pairs issue theirs in straight-line code, where ptxas keeps the products
    // asynchronous)
    auto pair = [&](const int j0, const int phase, auto last) {
        constexpr bool kLast = decltype(last)::value;
        const bool has1 = !kLast || j0 + 1 < part_end;  // (every pair but the last has both tiles)
        // this pair's successors' source rows (their page lookups in flight during the products)
        const TileSource next0 = source(j0 + 2), next1 = source(j0 + 3);

        // [fa2-fwd 2] S = Q K^T of this warpgroup's tile, chunk by chunk as the chunks land ([mla early s0]: wg 0's
        // issued at the end of the pair before)
        bool tail = false;  // this warpgroup's tile is a partial last one, its V tail zeroed (kTma)
        if (wg == 0 || has1) {
            if (!kEarlyS0 || wg == 1) {
                issue_s(0, 9, phase);
                wgmma_wait<0>();
            }
            fence_regs(s);
            tail = zero_tail(wg == 0 ? tile0 : tile1, j0 + wg);
            mod_mask_scale(s, p, (j0 + wg) * kBlockN, row_t, slope, blk.offset, blk.len_k, lane & 3);
        } else {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = -CUFLASH_INF;
        }
        float mx[2];
        row_max(s, mx);
        if (wg == 0) {
            // [fa2-fwd 3] m0, shared with wg 1; [fa2-fwd 4] P0; [fa2-fwd 5] O[:, :256] += P0 V0
            float m0[2] = {fmaxf(m[0], mx[0]), fmaxf(m[1], mx[1])};
            if ((lane & 3) == 0) sM0[rw + g] = m0[0], sM0[rw + g + 8] = m0[1];
            handover(kBarM0, tail);
            softmax_rows(s, m, m0, l, acc);
            u32 a[kPT][4];
#pragma unroll
            for (int kk = 0; kk < kPT; ++kk) c_to_a<T, kNT>(a[kk], s, kk);
            issue_pv(a, 0);
            // (P0 V0 in flight:) wg 1's m1 and exp2(m0 - m1), and P1; then P0 at max m1 for wg 1
            named_bar_sync(kBarM1, kThreads);
            float f1[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                f1[hh] = sF1[rw + g + 8 * hh];
                m[hh] = sM1[rw + g + 8 * hh];
            }
            store_p<T>(sP0, s, f1, rw, lane);
            named_bar_arrive(kBarP0, kThreads);
            wgmma_wait<0>();
            fence_regs(acc);
            // buffer 0's chunks 0-3 (V0's left half) are done with: the pair after next's tile into them
            if (j0 + 2 < part_end) loader.template load<0, 4>(tile0, full(0, 0), next0);
            rescale_rows(acc, l, f1);
            if (has1) {
                // O[:, :256] += P1 V1, P1 from shared memory
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) load_a<kBlockN>(a[kk], sP1, rw, kk, lane);
                issue_pv(a, 1);
                // [mla early s0] the next pair's S0 over the chunks this warpgroup loaded (its P0 is in shared
                // memory: s is free), under P1 V1
                constexpr bool early = kEarlyS0 && !kLast;
                if constexpr (early) {
                    issue_s(0, 4, phase ^ 1);
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                fence_regs(acc);
                // buffer 1's chunks 0-3 (V1's left half) and its rope chunk (P1) are done with: the product that
                // read P1 has completed, so every warp of the warpgroup has read it (TMA: one thread overwrites
                // the whole chunk)
                if (j0 + 3 < part_end) {
                    loader.template load<0, 4>(tile1, full(1, 0), next1);
                    loader.template load<8, 9>(tile1, full(1, 0), next1);
                }
                if constexpr (early) {
                    issue_s(4, 9, phase ^ 1);  // (the chunks wg 1 loads at the end of its pair)
                    wgmma_wait<0>();  // (waited for within the pair: nothing in flight across the loop's back edge)
                }
            }
        } else {
            // [fa2-fwd 3] m1 from wg 0's m0; [fa2-fwd 4] P1 (to shared memory for wg 0); [fa2-fwd 5] O[:, 256:] +=
            // P1 V1 + (P0 exp2(m0 - m1)) V0
            named_bar_sync(kBarM0, kThreads);
            float m0[2], m1[2], f1[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                m0[hh] = sM0[rw + g + 8 * hh];
                m1[hh] = fmaxf(m0[hh], mx[hh]);
                f1[hh] = fast_exp2(m0[hh] - (m1[hh] == -CUFLASH_INF ? 0.f : m1[hh]));
            }
            softmax_rows(s, m, m1, l, acc);
            m[0] = m1[0], m[1] = m1[1];
            if ((lane & 3) == 0) {
                sM1[rw + g] = m1[0], sM1[rw + g + 8] = m1[1];
                sF1[rw + g] = f1[0], sF1[rw + g + 8] = f1[1];
            }
            const float one[2] = {1.f, 1.f};
            if (has1) store_p<T>(sP1, s, one, rw, lane);
            handover(kBarM1, tail);
            u32 a[kPT][4];
            if constexpr (CUFLASH_MLA_P0_FIRST && !kLast) {
                // [mla p0 first] P0 V0 before P1 V1: buffer 0's chunks 4-8, which the next pair's S0 waits for, are
                // reloaded one product earlier
                named_bar_sync(kBarP0, kThreads);  // P0 at max m1
                u32 a0[kPT][4];
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) load_a<kBlockN>(a0[kk], sP0, rw, kk, lane);
                issue_pv(a0, 0);
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) c_to_a<T, kNT>(a[kk], s, kk);
                issue_pv(a, 1);
                wgmma_wait<1>();  // P0 V0 done: buffer 0's chunks 4-7 and its rope chunk (P0) are free
                if (j0 + 2 < part_end) loader.template load<4, 9>(tile0, full(0, 0), next0);
                wgmma_wait<0>();  // P1 V1 done: buffer 1's chunks 4-7 are free
                fence_regs(acc);
                if (j0 + 3 < part_end) loader.template load<4, 8>(tile1, full(1, 0), next1);
            } else {
                if (has1) {
#pragma unroll
                    for (int kk = 0; kk < kPT; ++kk) c_to_a<T, kNT>(a[kk], s, kk);
                    issue_pv(a, 1);
                }
                named_bar_sync(kBarP0, kThreads);  // P0 at max m1
                u32 a0[kPT][4];
#pragma unroll
                for (int kk = 0; kk < kPT; ++kk) load_a<kBlockN>(a0[kk], sP0, rw, kk, lane);
                issue_pv(a0, 0);
                wgmma_wait<1>();  // P1 V1 done: buffer 1's chunks 4-7 are free
                if (j0 + 3 < part_end) loader.template load<4, 8>(tile1, full(1, 0), next1);
                wgmma_wait<0>();  // P0 V0 done: buffer 0's chunks 4-7 and its rope chunk (P0, read by every warp) are
                                  // free
                fence_regs(acc);
                if (j0 + 2 < part_end) loader.template load<4, 9>(tile0, full(0, 0), next0);
            }
        }
    };
    int j0 = part_first, phase = 0;
    for (; j0 + 2 < part_end; j0 += 2, phase ^= 1) pair(j0, phase, Flag<false>());
    if (j0 < part_end) pair(j0, phase, Flag<true>());

    finish_wide_rows<T, kDV, kBlockM, kNWarps, 2, kDT>(p, blk, acc, m, l, sSum, page_fault, rw, wg, tid);
}

}  // namespace cuflash
