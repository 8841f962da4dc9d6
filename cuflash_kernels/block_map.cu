// cuflash block sparsity of a user mask_mod (the kernels' side of cuflash/_mods.py:block_map, compacted).
//
// Two launches build, for every row tile of one launch's tiling (a query tile of kBM rows for the forward and
// dQ passes; with kTransposed, a key tile of kBN keys for the dK/dV pass), the list of column tiles that hold
// at least one visible score, ascending, and their number:
//
// block_status_kernel: one thread block per (column tile, row tile, head x batch of the map), 128 threads over
//   the tile's kBM x kBN scores: status 0 (no visible score: skipped), 1 (partial: some score the lengths and
//   the band leave visible fails mask_mod, so the attention kernels evaluate mask_mod score by score) or 2 (full:
//   every such score passes mask_mod, none is evaluated again). Visible is what the attention kernels see:
//   inside the sequence's lengths, inside the band (causal, window: BlockInfo::visible) and mask_mod. Column
//   tiles outside the row's band range (BlockInfo::key_tiles / query_tiles, the attention kernels' loop
//   bounds) are 0 without evaluation. One block per tile, so that the grid fills the GPU however few row tiles
//   a call has (N 8192 in tiles of 128: 64 row tiles, 4096 tiles).
// block_compact_kernel: one warp per row tile: the column tiles whose status is not 0, ascending (a ballot and
//   a prefix count per 32 columns), each entry the tile index with kFullTile (variants.cuh) set when full.
//
// The NumPy reference's block map (cuflash/_mods.py) calls a tile full when every score inside the lengths
// passes mask_mod; here the band's scores are left out too (the band mask still applies to them), so a few
// more tiles are full: the same results, less mask_mod work.
//
// Grid of both: (.., rows or columns as above, Hm x Bm), Hm = heads_q when mask_mod reads h (else 1), Bm = batch
// when mask_mod reads b or the sequences have their own lengths (else 1): the lists broadcast over the other
// axes. status: (Bm, Hm, rows, cols) int8; count: (Bm, Hm, rows) int32; list: (Bm, Hm, rows, cols) int32,
// entries past count unspecified.
#include "cuflash_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"

namespace cuflash {

template <class V, int kBM, int kBN, bool kTransposed>
__global__ void __launch_bounds__(128)
block_status_kernel(signed char* __restrict__ status, int rows, int cols, int heads_map, int seqlen_q, int seqlen_k,
                    const VariantParams vp) {
    static_assert(V::Mod::Has_mask_mod, "block lists come from a mask_mod");
    const int c = blockIdx.x, r = blockIdx.y, h = blockIdx.z % heads_map, b = blockIdx.z / heads_map;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    int first = 0, end = 0;
    if constexpr (kTransposed) {
        if (r * kBN < bi.len_k) {
            const int2 qt = bi.template query_tiles<kBM, kBN>(r * kBN);
            first = qt.x;
            end = qt.y;
        }
    } else {
        if (r * kBM < bi.len_q) {
            const int2 kt = bi.template key_tiles<kBN, kBM>(r * kBM);
            first = kt.x;
            end = kt.x + kt.y;
        }
    }
    signed char result = 0;
    if (c >= first && c < end) {  // (uniform over the block)
        const int q0 = kTransposed ? c * kBM : r * kBM;
        const int k0 = kTransposed ? r * kBN : c * kBN;
        bool any = false, fails = false;
        for (int e = threadIdx.x; e < kBM * kBN; e += 128) {
            const int i = q0 + e / kBN, j = k0 + e % kBN;
            if (i < bi.len_q && bi.visible(i, j)) {
                const bool keep = V::Mod::mask(bi.b, bi.h, i, j, *bi.mods);
                any = any || keep;
                fails = fails || !keep;
            }
        }
        any = __syncthreads_or(any);
        fails = __syncthreads_or(fails);
        result = any ? (fails ? 1 : 2) : 0;
    }
    if (threadIdx.x == 0) status[(((i64)blockIdx.z * rows) + r) * cols + c] = result;
}

__global__ void __launch_bounds__(32)
block_compact_kernel(const signed char* __restrict__ status, int* __restrict__ count, int* __restrict__ list, int cols) {
    const i64 row = (i64)blockIdx.z * gridDim.y + blockIdx.y;
    const signed char* st = status + row * cols;
    int* out = list + row * cols;
    const int lane = threadIdx.x;
    int n = 0;
    for (int c0 = 0; c0 < cols; c0 += 32) {
        const int c = c0 + lane;
        const int s = c < cols ? st[c] : 0;
        const unsigned live = __ballot_sync(0xffffffffu, s != 0);
        if (s != 0) out[n + __popc(live & ((1u << lane) - 1u))] = c | (s == 2 ? kFullTile : 0);
        n += __popc(live);
    }
    if (lane == 0) count[row] = n;
}

}  // namespace cuflash
