// cuflash MLA decoding on Hopper (sm_90a): flash_decode_wide_kernel's algorithm for MLA's absorbed decoding (one
// latent key/value head of 576 = 512 + 64 rope dims, V the first 512 columns of the K tile), its products on the
// tensor cores' wgmma instead of mma.sync. decode.cu holds the parameters, the guards, the loads, the masks and the
// merge; this file the kernel body (cuflash/_cuda/decode.py launches it for MLA on sm_90).
//
// One block of 64 packed rows (query heads x query tokens, [decode pack]) and two warpgroups walks its split's
// key tiles of 64 keys ([decode split]), each tile loaded once into shared memory (72 KiB, 128-byte swizzle, a
// two-stage cp.async ring) and read twice, as K (all 576 columns) and as V (its first 512). Warpgroup wg:
//   [fa2-fwd 2] S = Q K^T for the tile's keys 32 wg .. 32 wg + 31 (wgmma m64n32k16 from shared memory, 36 steps);
//   [fa2-fwd 3] the row maxima of both warpgroups exchanged through shared memory (both rescale by the same max);
//   [fa2-fwd 4] P = exp2(S - m) of its keys into shared memory (16-bit, as the reference casts P), its row sums;
//   [fa2-fwd 5] O[:, 256 wg .. 256 wg + 255] += P V over all 64 keys (P read back as wgmma's register operand,
//               V from the K tile, MN-major: wgmma m64n256k16, 4 steps).
// O of 64 rows x 512 columns would need 256 float32 registers per thread in one warpgroup; split by columns, each
// warpgroup holds 128. [fa2-fwd 6], the output, the split partials and the fused merge are flash_decode_wide_kernel's.
#include "decode.cu"
#include "hopper_tiles.cuh"

namespace cuflash {

// The 128-byte-swizzled layout of a kRows-row tile (hopper_tiles.cuh), as decode.cu's loads take a layout.
template <int kRows>
struct Sw128 {
    __device__ __forceinline__ static int offset(int r, int c) { return sw128_offset<kRows>(r, c); }
};

// Keys [n0, n0 + 64) of the sequence's latent cache (576 columns) into a 128-byte-swizzled tile, as decode.cu's
// load_cache_tile (zeros past len_k, [decode page], [decode guard], fused [decode append]), with 4 threads per
// key: each finds its key's source row once (its page, or its k_new row) and copies every fourth of the row's 72
// 16-byte chunks, so that a tile costs a thread one lookup and 18 copies, not 18 lookups.
template <bool kPaged>
__device__ __forceinline__ void load_latent_tile(u16* tile, const u16* base, const DecodeParams& p, const int* pages,
                                                 int cache_row, int slot0, int n0, int len_k, int tid,
                                                 bool& page_fault, const NewRows& fresh) {
    constexpr int kRows = 64, kChunks = 576 / 8;
    const int r = tid >> 2, q = tid & 3;
    const int key = n0 + r;
    bool valid = key < len_k;
    const u16* src = base;
    if (valid) {
        if constexpr (kPaged) {
            const int slot = slot0 + key, index = page_index(p, slot);
            const int page = pages[index];
            if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.cache_rows)) {
                valid = false;  // (a new token's slot too: its rows NaN, as if the block had read the cache)
                page_fault = true;
            } else {
                src = base + (i64)page * p.k_sb + (i64)(slot - index * p.page_size) * p.k_ss;
            }
        } else {
            src = base + (i64)cache_row * p.k_sb + (i64)(slot0 + key) * p.k_ss;
        }
        // [decode append] fused: a new token's row from k_new, not from its (not yet written) cache slot
        if (valid && key >= fresh.first) src = fresh.base + (i64)(key - fresh.first) * fresh.ss;
    }
    // sw128_offset<kRows>(r, c) with the row's part taken out of the loop (called per copy, ptxas keeps 16 more
    // registers live)
    const u32 dst = smem_u32(tile) + 2 * (r * 64);
    if (!valid) src = base;  // (copies of 0 bytes: any address in the cache, selected once, not per copy)
#pragma unroll
    for (int k = 0; k < kChunks / 4; ++k) {
        const int c = q + 4 * k;
        cp_async_16(dst + 2 * ((c >> 3) * (kRows * 64) + (((c & 7) ^ (r & 7)) << 3)), src + c * 8, valid);
    }
}

template <class T, bool kPaged>
__global__ void __launch_bounds__(256, 1)
flash_decode_mla_sm90_kernel(const DecodeParams p) {
    constexpr int kHeadDim = 576, kDV = 512, kBlockM = 64, kBlockN = 64, kNWarps = 8, kThreads = 256;
    constexpr int kTileK = kBlockN * kHeadDim;  // one stage of the ring: 64 keys x 576
    constexpr int kKT = kHeadDim / 16;          // k16 steps of S
    constexpr int kWN = kBlockN / 2, kNT = kWN / 8;  // keys of S per warpgroup, its n8 tiles
    constexpr int kWV = kDV / 2, kDT = kWV / 8;      // columns of O per warpgroup, its n8 tiles
    constexpr int kPT = kBlockN / 16;                // k16 steps of P V

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);              // 64 x 576, 128-byte swizzle
    u16* sK = sQ + kBlockM * kHeadDim;                        // 2 stages of 64 x 576, 128-byte swizzle
    u16* sP = sK + 2 * kTileK;                                // 64 x 64, decode.cu's swizzle (ldmatrix)
    float* sMax = reinterpret_cast<float*>(sP + kBlockM * kBlockN);  // 64 x 2 (row, warpgroup)
    float* sSum = sMax + kBlockM * 2;

    const WideBlock<kBlockM, kBlockN, kPaged> blk(p);
    const int b = blk.b, h_kv = blk.h_kv, part_first = blk.part_first, part_end = blk.part_end;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int wg = warp >> 2;           // warpgroup: keys of S, columns of O
    const int rw = (warp & 3) * 16;     // the warp's 16 rows within the block (wgmma: warp w of a warpgroup)
    bool page_fault = false;  // [decode guard] a page id out of range among the slots this block loaded

    const u16* kbase = p.k_cache + (i64)h_kv * p.k_sh;
    const bool fuse = p.fuse_new != 0;  // [decode append] fused: new keys read from k_new
    const int new_first = fuse ? blk.seqlen - blk.leftpad : blk.len_k;
    const NewRows knew{p.k_new + b * p.kn_sb + (i64)h_kv * p.kn_sh, p.kn_ss, new_first};
    auto load_tile = [&](int j, int buf) {
        load_latent_tile<kPaged>(sK + buf * kTileK, kbase, p, blk.pages, blk.cache_row, blk.leftpad, j * kBlockN,
                                 blk.len_k, tid, page_fault, knew);
    };

    load_packed_q<kBlockM, kHeadDim, kThreads, Sw128<kBlockM>>(sQ, p, b, h_kv, blk.r0, blk.packed, tid);
    if (part_first < part_end) load_tile(part_first, 0);
    cp_async_commit();
    if (fuse && blk.in_range && blk.rt == 0 && blk.split == 0)
        append_head<kHeadDim, kDV, true, kPaged, kThreads>(p, b, h_kv, blk.seqlen, blk.cache_row, tid);

    int row_t[2];
    float slope[2];
    packed_rows(p, b, h_kv, blk.r0 + rw, blk.packed, g, row_t, slope);

    // Descriptors (hopper_tiles.cuh's layout note): Q and K K-major, this warpgroup's 32 keys 32 rows into each
    // column block of K; V MN-major from the K tile's column blocks 4 wg .. 4 wg + 3.
    // A descriptor's address field is (address >> 4) in its low 14 bits: below 256 KiB an offset adds to it
    // without carrying out, so each base descriptor is built once and the steps add constants.
    const u32 q_addr = smem_u32(sQ), k_addr = smem_u32(sK);
    const u64 desc_q0 = sw128_desc(q_addr, 16, 1024);
    const u64 desc_k0 = sw128_desc(k_addr + wg * kWN * 128, 16, 1024);
    const u64 desc_v0 = sw128_desc(k_addr + wg * (kWV / 64) * kBlockN * 128, kBlockN * 128, 1024);
    auto desc_q = [&](int kk) { return desc_q0 + (u64)(((kk >> 2) * kBlockM * 128 + (kk & 3) * 32) >> 4); };
    auto desc_k = [&](int buf, int kk) {
        return desc_k0 + (u64)((buf * kTileK * 2 + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32) >> 4);
    };
    auto desc_v = [&](int buf, int kk) { return desc_v0 + (u64)((buf * kTileK * 2 + kk * 2048) >> 4); };

    float acc[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
    float m[2] = {-CUFLASH_INF, -CUFLASH_INF}, l[2] = {0.f, 0.f};  // l: this warpgroup's keys only

    for (int j = part_first; j < part_end; ++j) {
        const int buf = (j - part_first) & 1;
        cp_async_wait<0>();   // Q and tile j have landed (this thread's copies) ...
        fence_proxy_async();  // ... visible to the tensor cores ...
        __syncthreads();      // ... for every thread; every warp is done with tile j - 1 and sP
        if (j + 1 < part_end) load_tile(j + 1, buf ^ 1);
        cp_async_commit();

        // [fa2-fwd 2] S = Q K^T over this warpgroup's 32 keys of the tile
        float s[kNT][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk) Wgmma<T>::ss(s, desc_q(kk), desc_k(buf, kk), kk > 0 ? 1 : 0, Int<kWN>());
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        mod_mask_scale(s, p, j * kBlockN + wg * kWN, row_t, slope, blk.offset, blk.len_k, t4);

        // [fa2-fwd 3], [fa2-fwd 4] the row maxima of both warpgroups; P of its keys into sP
        exchange_softmax<T, kBlockN, 2>(s, m, l, acc, sMax, sP, rw, wg, lane);
        __syncthreads();  // P of both warpgroups is in sP

        // [fa2-fwd 5] O[:, this warpgroup's columns] += P V, P as the register operand
        u32 a[kPT][4];
#pragma unroll
        for (int kk = 0; kk < kPT; ++kk) load_a<kBlockN>(a[kk], sP, rw, kk, lane);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kPT; ++kk) Wgmma<T>::rs_tb(acc, a[kk], desc_v(buf, kk), 1, Int<kWV>());
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc);
    }
    cp_async_wait<0>();

    finish_wide_rows<T, kDV, kBlockM, kNWarps, 2, kDT>(p, blk, acc, m, l, sSum, page_fault, rw, wg, tid);
}

}  // namespace cuflash
