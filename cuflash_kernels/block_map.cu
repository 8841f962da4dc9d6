// cuflash block sparsity of a user mask_mod (the kernels' side of cuflash/_mods.py:block_map, compacted).
//
// block_lists_kernel: for every row tile of one launch's tiling (a query tile of kBM rows for the forward
// and dQ passes; with kTransposed, a key tile of kBN keys for the dK/dV pass), the column tiles that hold
// at least one visible score, ascending, and their number. Visible is what the attention kernels see:
// inside the sequence's lengths, inside the band (causal, window: BlockInfo::visible) and mask_mod. Only
// the column tiles of the row's band range are looked at (BlockInfo::key_tiles / query_tiles, the loop
// bounds the attention kernels would use), each by the whole block, 128 threads over its kBM x kBN scores,
// a thread stopping at its first visible score; a tile with none costs all kBM x kBN evaluations.
//
// Grid: (row tiles, Hm, Bm), where Hm = heads_q when mask_mod reads h (else 1) and Bm = batch when mask_mod
// reads b or the sequences have their own lengths (else 1): the lists broadcast over the other axes.
// count: (Bm, Hm, rows) int32; list: (Bm, Hm, rows, cols) int32, entries past count unspecified.
#include "cuflash_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"

namespace cuflash {

template <class V, int kBM, int kBN, bool kTransposed>
__global__ void __launch_bounds__(128)
block_lists_kernel(int* __restrict__ count, int* __restrict__ list, int rows, int cols, int seqlen_q, int seqlen_k,
                   const VariantParams vp) {
    static_assert(V::Mod::Has_mask_mod, "block lists come from a mask_mod");
    const int r = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    const i64 row = ((i64)b * gridDim.y + h) * rows + r;
    int* out = list + row * cols;
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
    end = min(end, cols);
    int n = 0;
    for (int c = first; c < end; ++c) {
        const int q0 = kTransposed ? c * kBM : r * kBM;
        const int k0 = kTransposed ? r * kBN : c * kBN;
        bool any = false;
        for (int e = threadIdx.x; e < kBM * kBN && !any; e += 128) {
            const int i = q0 + e / kBN, j = k0 + e % kBN;
            any = i < bi.len_q && bi.visible(i, j) && V::Mod::mask(bi.b, bi.h, i, j, *bi.mods);
        }
        if (__syncthreads_or(any)) {
            if (threadIdx.x == 0) out[n] = c;
            ++n;
        }
    }
    if (threadIdx.x == 0) count[row] = n;
}

}  // namespace cuflash
