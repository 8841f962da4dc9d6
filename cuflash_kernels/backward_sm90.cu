// cuflash Hopper backward kernel (sm_90a, wgmma), FlashAttention-3 style dK/dV(+dQ), mirroring
// cuflash/reference.py:blocked_backward (order "kv_outer"; with Has_dQ = false the first pass of "split")
// and flash_bwd_dkdv_kernel in backward.cu, whose kernel arguments, grid, dQ workspace and GQA workspace it
// keeps: the launcher (cuflash/_cuda.py, TILES rows ("bwd", "sm90a", d)) swaps it in for the dK/dV kernel
// on sm_90 at head dims 64 and 128 (and 256 with [bwd shared keys], below, where switched on); the preprocess,
// convert-dQ, GQA-reduce and split-order dQ kernels stay those of backward.cu.
//
// Algorithm (flash_bwd_dkdv_sm90_kernel): one thread block owns one key/value tile of kBlockN = 64 rows
// per warpgroup (kNWarps / 4 computing warpgroups; no producer warpgroup yet) of one (batch, query head);
// K and V stay in shared memory for the whole block, in the 128-byte-swizzled layout that wgmma
// descriptors read (hopper_tiles.cuh). The block streams the query tiles of kBlockM = 64 rows: Q, dO and
// the rows' lse and D double-buffered with cp.async, the next tile loading while this one is computed.
// Per query tile, each warpgroup, for its 64 key rows (everything transposed, keys are the M dimension):
//   [bwd 1] S^T  = K Q^T                 wgmma m64 n64 k16, A = K, B = Q, both K-major in shared memory
//   [bwd 3] dP^T = V dO^T                the same with V, dO (issued right after S^T; both in flight)
//   [bwd 1] P^T  = exp2(S^T * scale * log2 e - lse * log2 e), masked, packed to 16 bits (A fragments)
//   [bwd 4] dS^T = P^T (dP^T - D)         with P^T as rounded to the input dtype, packed to 16 bits
//   [bwd 2] dV  += P^T dO                wgmma m64 n=d k16, A = P^T from registers, B = dO MN-major
//   [bwd 6] dK  += dS^T Q                the same with dS^T and Q
//   [bwd 5] dQ  += dS K (Has_dQ)         dS^T is written to shared memory (swizzled, 16-bit); after a
//       block barrier each warpgroup computes a 64 x d / kNWG slice of dS K with wgmma, A = dS^T read as dS
//       (MN-major, transpose bit), B = K (MN-major, transpose bit), and adds it to the float32 dQ workspace
//       with red.global.add.v2.f32; flash_bwd_convert_dq_kernel scales and casts. [bwd dq tile] The TMA entry
//       point adds the whole tile by one bulk reduction instead (below). The
//       warpgroups split the head-dim columns of dQ (measured on the H100 against splitting the keys, each warpgroup a
//       full-width partial over its own 64 keys: the column split is 15-30% faster, half the reductions).
// dK = scale * dK_acc and dV are written as backward.cu does: straight to dk / dv for MHA, per query head
// into the float32 workspace (2, B, H_q, N_k, d) for GQA/MQA (flash_bwd_reduce_dkv_kernel sums groups).
// Causal: query tiles wholly above the key tile's diagonal are skipped (query i sees key j iff
// j <= i + causal_offset); only tiles that cross it, or the end of K, are masked element by element.
// Rows past seqlen_q are zero-filled (dO = 0, D = 0, lse = 0: they add nothing); rows that see no key
// (lse = -inf) meet only masked tiles, so their P is 0, never NaN.
//
// [variant bias tile] A staged bias (V::Bias::kStaged): the bias of each query tile's scores (kBlockM queries x
// kBlockN keys, its own dtype) is copied with cp.async with the tile's Q and dO, into the tile's buffer, and the
// recomputation of P^T reads it from there (16-bit: one transposed ldmatrix per 16 queries). dbias = dS is written
// straight from the fragments: for each element a warp writes 4 query rows x 8 consecutive keys, whole 32-byte
// sectors (float32) or halves that the same thread's next store completes (16-bit).
//
// Grid: (ceil(seqlen_k / kBlockN), heads_q, batch), 32 * kNWarps threads, in the order of interleaved_block
// (cuflash_tiles.cuh: under a causal mask the launcher interleaves the key tiles of 4 (batch, head) pairs, the
// longest blocks first); key/value head = query head / group.
// Shared memory (16-bit tiles, each 1024-byte aligned): K, V kBlockN x d; 2 x (Q, dO) kBlockM x d;
// dS^T kBlockN x kBlockM; float32 lse, D 2 x kBlockM each; + 1024 for alignment (Sm90BwdConfig::kSmemBytes):
// d = 128, kBlockN = 128: 146 KiB (one block per SM); d = 64, kBlockN = 128: 82 KiB. A staged bias adds
// 2 x kBlockM x kBlockN entries (d = 128, bf16: + 32 KiB; float32: + 64 KiB).
#include "cuflash_tiles.cuh"
#include "hopper_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"

namespace cuflash {

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct Sm90BwdConfig {
    static constexpr int kNWG = kNWarps / 4;  // computing warpgroups, 64 key rows each (or [bwd shared keys] 64 shared)
    // [bwd shared keys] (d 256: Tile(64, 64, 8, 2)) both warpgroups on the block's 64 keys: S^T and dP^T split by
    // queries (kSN each), dK and dV by head-dim columns (kDN each), P^T and dS^T through shared memory
    static constexpr bool kShareKeys = kBlockN == 8 * kNWarps && kNWG == 2;
    static constexpr int kSN = kShareKeys ? kBlockM / kNWG : kBlockM;  // S^T / dP^T query columns per warpgroup
    static constexpr int kDN = kShareKeys ? kHeadDim / kNWG : kHeadDim;  // dK / dV columns per warpgroup
    // dQ = dS K over all keys: each warpgroup a slice of the head-dim columns of the 64 query rows, or [bwd rows 128]
    // with 128 query rows, its own 64 rows and every column
    static constexpr bool kDqRowSplit = kBlockM == 128;
    static constexpr int kDqN = kDqRowSplit ? kHeadDim : kHeadDim / kNWG;  // dQ columns per warpgroup
    // ([bwd shared keys]: P^T's tile after dS^T's)
    static constexpr int kSmemBytes = 2 * (2 * kBlockN * kHeadDim + 4 * kBlockM * kHeadDim +
                                           (kShareKeys ? 2 : 1) * kBlockN * kBlockM) + 4 * 4 * kBlockM + 1024;
    // The TMA entry point's float32 dQ tile ([bwd dq tile]'s, kBlockM x kHeadDim of it), after its 64 bytes of
    // mbarriers, sized with rows of kHeadDim + 8 floats (the removed [bwd dq bulk]'s padded rows)
    static constexpr int kDqStride = kHeadDim + 8;
    // [bwd flow] dS^T's second buffer after it, 1024-byte aligned ([bwd shared keys]: no dQ tile; the second dS^T and
    // P^T right after the first ones, before the rows' statistics)
    static constexpr int kTmaSmemBytes = kShareKeys ? kSmemBytes + 64 + 4 * kBlockN * kBlockM
                                                    : kSmemBytes + 64 + 4 * kBlockM * kDqStride + 2 * kBlockN * kBlockM + 1024;
};

// Measured slower and removed (session 24; docs/kernel-notes.md keeps their numbers): [bwd dq bulk], dQ added by a
// bulk reduction a fragment row from a padded float32 tile (kDqStride's 8 floats), and [bwd dq v4], dQ added by
// red.global.add.v4.f32 after two shuffles a column block.
// [bwd dq tile] (on: 1; 0 restores the per-fragment red.global.add) the TMA entry point adds its dQ tile by one bulk
// reduction (FlashAttention-3's dQaccum order): each thread stores its dQ accumulators contiguously to a float32 tile
// in shared memory, in the fragments' order (its float4 chunks rotated by dq_tile_slot: a quarter-warp's 16-byte stores
// fall in distinct banks), and after a named barrier one thread adds the whole tile (64 rows, 16 or 32 KiB) with one
// cp.reduce.async.bulk .add.f32 into the workspace, whose per-head planes are then padded to a multiple of 64 rows and
// in that order too; flash_bwd_convert_dq_tiles_kernel reads them back. One bulk operation a query tile in place of
// 2048-4096 red.global.add.v2.f32. The launcher reads the switch too (attention.BWD_DQ_TILE). H200 2026-11-29, bf16,
// backward alone (tools/bwd_ab.py, one round, against the shipped build): d 128 N 8192 dense 557 against 467 TFLOP/s,
// causal 547 against 471; N 1000 379 / 279 against 335 / 258; d 64 N 8192 390 / 390 against 370 / 348, N 1000 +2-6 %;
// dK, dV bit for bit, dQ within the additions' order (max |diff| 5e-4 - 1e-3). Switched on after 607 GPU tests (13
// files: attention, variants, head dims, torch, compile, graphs, flash_attn) passed with it and compute-sanitizer
// memcheck found 0 errors (H200 2026-11-29, session 22).
#ifndef CUFLASH_BWD_DQ_TILE
#define CUFLASH_BWD_DQ_TILE 1
#endif
// [bwd dq tile] The float4 chunk of shared memory (and of the workspace tile) that holds accumulators dq[dt][0..3] of
// computing thread `thread` (of 256: two warpgroups, each a slice of kDqN columns of dQ: kChunks = kDqN / 8 float4
// chunks a thread): chunks rotated per thread so that the 8 threads of a 128-byte store phase hit 8 different 16-byte
// bank groups.
template <int kChunks>
__device__ __forceinline__ int dq_tile_slot(int thread, int dt) {
    return dt ^ ((thread / (8 / kChunks)) % kChunks);
}
// ... and the float of that tile that holds element (r, c) (row r < kRows of the query tile, column c < kHeadDim):
// as the dK/dV kernel's two warpgroups split dQ (Sm90BwdConfig: 64 rows, the columns split; or [bwd rows 128] 128
// rows, each warpgroup 64 of them).
template <int kHeadDim, int kRows = 64>
__device__ __forceinline__ int dq_tile_pos(int r, int c) {
    using Cfg = Sm90BwdConfig<kHeadDim, kRows, 128, 8>;
    static_assert(kRows == 64 || kRows == 128, "dQ tile rows");
    constexpr int kDqN = Cfg::kDqN;
    const int cc = c % kDqN, rr = r % 64, wg = Cfg::kDqRowSplit ? r / 64 : c / kDqN;
    const int thread = wg * 128 + (rr >> 4) * 32 + (rr & 7) * 4 + ((cc & 7) >> 1);
    return thread * (kDqN / 2) + dq_tile_slot<kDqN / 8>(thread, cc >> 3) * 4 + ((rr >> 3) & 1) * 2 + (c & 1);
}

// [bwd persistent] (kPersistent, family bwd_dkdv_sm90_tma_persistent) the TMA entry point as a persistent kernel:
// one block per SM takes the tiles of the (key tile, head, sequence) grid in interleaved_block's order from a counter
// (its first blockIdx.x, then the next untaken one as it starts each tile: as the hardware hands out one-tile blocks,
// so causal masking's unequal tiles spread as they do there; a static walk of every gridDim.x-th tile was 4-14 %
// slower causal, H200 2026-11-29), and issues the next tile's first copies (K, V, the first query tile) before its
// stores of the current tile's dK and dV, so that their latency hides under the epilogue instead of opening every
// block. The launcher picks it by head dim (attention.BWD_PERSISTENT_DIMS: d 64, backward alone +3-6 % on the H200;
// d 128 within -2..+2 %).

// [bwd flow] on (1, the default: the TMA entry point with dQ has no barrier at the loop's top. A query buffer's lse
// and D copies arrive on its mbarrier with Q's and dO's (cp.async.mbarrier.arrive; the barrier expects one arrival per
// thread more); the next tile's copies are issued after dS^T's barrier, which every warp passes only once done with
// the previous tile; dS^T is double-buffered, so its stores need no barrier against the previous tile's dQ product)
// or off (0: the loop's top block barrier makes each tile's lse and D copies visible and frees the other query buffer
// and dS^T). H100 2026-11-28, bf16, backward alone, with [bwd dq first] on, against both off: d 128 N 4096-16384
// 394-464 against 311-399 TFLOP/s, d 64 323-379 against 277-323, N 1024 +8-14 %; dK, dV bit for bit with the
// cp.async kernel; compute-sanitizer memcheck, racecheck and synccheck clean.
#ifndef CUFLASH_BWD_FLOW
#define CUFLASH_BWD_FLOW 1
#endif

// [bwd dq first] on (1, the default: the block barrier for dS^T, then dQ's product issued first and dV's and dK's
// after it, dQ added into the workspace while they run) or off (0: dV's and dK's products issued, then the barrier,
// then dQ's product, waited for with them). H100 2026-11-28, bf16, backward alone, alone against off: TMA kernel d 128
// +6-26 % (N 4096 dense 425 against 367 TFLOP/s), cp.async kernel +2-15 %; one cell lower (d 64 N 16384 causal, TMA,
// 305 against 323), recovered with [bwd flow].
#ifndef CUFLASH_BWD_DQ_FIRST
#define CUFLASH_BWD_DQ_FIRST 1
#endif
// [bwd share dq] on (1, the default) [bwd shared keys]' two dQ chunks each under one of dV's and dK's products: dQ's
// first chunk and dV's product issued, the chunk added while dV's runs, then the second chunk and dK's, the same way;
// off (0), dV's and dK's products, then each chunk issued, waited for and added with the tensor cores idle. H200
// 2026-11-29, bf16, d 256, backward alone, three rounds over two calls against off: dense N 1024 253-256
// against 247-253 TFLOP/s, N 4096 311-314 against 301-302, causal N 1024 205-206 against 203-204, N 4096 284-290
// against 280-285 (+1-4 %); d 256's GPU tests pass either way. (ncu, d 256 N 4096 dense: the tensor pipe busy about
// a third of the cycles, L2 66 % busy with dQ's red.global.add, 35 % of the stalls on their registers (L1TEX
// scoreboard); the removed [bwd dq v4]'s red.global.add.v4 there: 297 against 311.)
#ifndef CUFLASH_BWD_SHARE_DQ
#define CUFLASH_BWD_SHARE_DQ 1
#endif

// The tensor maps of the TMA entry point: q, k, v and dO as 4-d tensors (columns, rows, heads, batch).
struct BwdMaps {
    const TensorMap *q, *k, *v, *dout;
    int* tiles;  // [bwd persistent] the launch's tile counter (two int32, zero at a launch)
};

// Template arguments as flash_bwd_dkdv_kernel's (the launcher's Tile): kBlockM streamed query rows (64),
// kBlockN = 16 * kNWarps key rows (64 per warpgroup; [bwd shared keys]: 8 * kNWarps, 64 shared by the two warpgroups,
// each with half the queries of S^T and dP^T and half the columns of dK and dV, P^T and dS^T through shared memory),
// kStages = 2 query buffers. kTma (the TMA entry point,
// flash_bwd_dkdv_sm90_tma_kernel): [bwd tma] K, V and each query tile's Q and dO are copied by one thread with
// tensor copies through `maps` (64-column boxes in the same swizzle, zeros past the tensors' rows), each landing
// on an mbarrier (K and V: full_kv; query buffer i: full_q + 8 i); the rows' lse and D stay cp.async copies (rows
// past seqlen_q read as zeros). Padded batches only (a packed or key-padded sequence ends inside its tensor, where a
// box reads the next rows as they are), no staged bias. [bwd tma pad] Head dims below the kernel's (Pads_head_dim: d 32
// on the 64 kernel, 96 on 128's): the maps hold the arrays' head dims and read zeros past them, so S^T, dP^T and the
// products see zero columns; dK and dV are stored in the arrays' columns only (the GQA workspace and dQ's keep the
// kernel's width: the reduce and convert kernels cut them).
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ,
          bool kTma = false, bool kPersistent = false>
__device__ __forceinline__ void flash_bwd_dkdv_sm90(CUFLASH_BWD_DKDV_PARAMS, const VariantParams vp,
                                                    const BwdMaps maps = BwdMaps{}) {
    using Cfg = Sm90BwdConfig<kHeadDim, kBlockM, kBlockN, kNWarps>;
    constexpr bool kShare = Cfg::kShareKeys;  // [bwd shared keys]
    static_assert(kHeadDim == 64 || kHeadDim == 128 || (kShare && kHeadDim == 256),
                  "head dim: whole 64-column swizzle blocks, n = d <= 128 (d 256: two warpgroups sharing the keys)");
    static_assert(kNWarps == 4 || kNWarps == 8, "one or two computing warpgroups");
    static_assert(kBlockN == 16 * kNWarps || kShare, "each warpgroup owns 64 key rows, or both share 64");
    static_assert(!kShare || (kBlockM == 64 && !V::Bias::kStaged), "[bwd shared keys]: 64 query rows, no staged bias");
    // [bwd rows 128] 128 query rows: the TMA entry point at d 64 with the whole-tile dQ (each warpgroup its 64 rows)
    static_assert(kBlockM == 64 || (kBlockM == 128 && kTma && kHeadDim == 64),
                  "query tile: 64 rows (wgmma n = 64 for S^T, m = 64 for dQ), or 128 for the TMA entry point at d 64");
    static_assert(kStages == 2, "two query buffers (the loop loads one tile ahead)");
    static_assert(Cfg::kDqN % 32 == 0, "dQ slice shape");
    static_assert(!kTma || (!V::Is_varlen && !V::Has_seqused && !V::Bias::kStaged),
                  "TMA: sequences that end with their tensors, no staged bias");
    static_assert(kTma || !V::Pads_head_dim, "head dims below the kernel's: the TMA entry point only ([bwd tma pad])");
    constexpr int kThreads = kNWarps * 32;
    constexpr int kNT = Cfg::kSN / 8;   // n8 fragments of an S^T row block (this warpgroup's queries)
    constexpr int kDT = Cfg::kDN / 8;   // n8 fragments of a dK / dV row block (this warpgroup's columns)
    constexpr int kKT = kHeadDim / 16;  // k16 steps of S^T and dP^T
    constexpr int kMT = kBlockM / 16;   // k16 steps of dV and dK (A fragments of P^T, dS^T)
    constexpr int kSMT = Cfg::kSN / 16;  // this warpgroup's A fragments of P^T, dS^T (kMT but [bwd shared keys])
    constexpr int kDqChunk = Cfg::kDqN > 64 ? 64 : Cfg::kDqN;  // dQ columns per wgmma batch
    constexpr int kQTile = kBlockM * kHeadDim;
    constexpr int kKVTile = kBlockN * kHeadDim;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // Swizzle atoms need 1024-byte alignment, whatever the alignment of the dynamic shared memory base.
    const u32 raw_addr = smem_u32(smem_raw);
    u16* sK = reinterpret_cast<u16*>(smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr));
    u16* sV = sK + kKVTile;
    u16* sQ = sV + kKVTile;                                             // 2 buffers
    u16* sdO = sQ + 2 * kQTile;                                         // 2 buffers
    u16* sdSt = sdO + 2 * kQTile;                                       // dS^T, kBlockN x kBlockM
    // [bwd shared keys] P^T's tile after dS^T's (the TMA entry point: then the second dS^T and P^T)
    u16* sPt = sdSt + kBlockN * kBlockM;
    constexpr int kPtTiles = kShare ? (kTma ? 3 : 1) : 0;
    float* sLse = reinterpret_cast<float*>(sdSt + (1 + kPtTiles) * kBlockN * kBlockM);  // 2 x kBlockM, raw lse
    float* sD = sLse + 2 * kBlockM;                                     // 2 x kBlockM, D
    // [variant bias tile] 2 x (kBlockM x kBlockN) bias entries (V::Bias::kStaged)
    using BiasT = typename BlockInfo<V>::BiasT;
    constexpr bool kStagedBias = V::Bias::kStaged;
    constexpr int kBiasTile = kBlockM * kBlockN;
    BiasT* sBias = reinterpret_cast<BiasT*>(sD + 2 * kBlockM);
    // [bwd tma] mbarriers where a staged bias would be (the TMA entry point stages none): K and V landed, query
    // buffer 0, 1 landed
    const u32 full_kv = smem_u32(sD + 2 * kBlockM), full_q = full_kv + 8;
    // [bwd dq tile] the float32 dQ tile in fragment order, after the 64 bytes of mbarriers; thread kDqIssuer adds it
    constexpr bool kDqTile = kTma && Has_dQ && CUFLASH_BWD_DQ_TILE && !kShare;
    constexpr int kDqIssuer = 32;  // (warp 1's first lane: thread 0 issues the TMA copies)
    float* sDq = sD + 2 * kBlockM + 16;
    // [bwd flow] the TMA entry point with dQ: no barrier at the loop's top, dS^T in two buffers (the second after the
    // dQ tile; [bwd shared keys] after P^T's, P^T's second after it)
    constexpr bool kFlow = kTma && Has_dQ && CUFLASH_BWD_FLOW;
    u16* const sdSt2 = kShare ? sPt + kBlockN * kBlockM : reinterpret_cast<u16*>(
        smem_raw + (((smem_u32(sDq + kBlockM * Cfg::kDqStride) + 1023u) & ~1023u) - raw_addr));
    u16* const sPt2 = sdSt2 + kBlockN * kBlockM;  // ([bwd shared keys] [bwd flow])
    // [bwd dq first] where a warpgroup's dQ slice is one batch of columns (two computing warpgroups)
    constexpr bool kDqFirst = Has_dQ && CUFLASH_BWD_DQ_FIRST && Cfg::kDqN == kDqChunk;
    static_assert(!kDqTile || (kDqFirst && Cfg::kNWG == 2), "[bwd dq tile]: one dQ product a tile, two warpgroups");
    static_assert(!Cfg::kDqRowSplit || !Has_dQ || kDqTile, "[bwd rows 128]: dQ by the whole-tile path only");

    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp_in_wg = (tid >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;

    // [bwd persistent] The tiles this block runs: its own (blockIdx), or with kPersistent those of the (key tile,
    // head, sequence) grid in interleaved_block's order it takes from maps.tiles ([0]: the tiles taken after each
    // block's first; [1]: the blocks done taking, the last of which sets both back to zero), blockIdx.x first
    // (`interleave` then holds the order's pairs in its low 8 bits and the batch above them: the launch's grid is one
    // dimension). Thread 0 takes the next tile as a tile starts and stores it in sched[pass & 1] at the tile's end
    // (the atomic's latency hidden under the tile), read by every thread after the tile's barrier.
    static_assert(kTma || !kPersistent, "[bwd persistent]: the TMA entry point's");
    const int tiles_x = (seqlen_k + kBlockN - 1) / kBlockN;
    const int batches = kPersistent ? interleave >> 8 : 1;
    const int n_tiles = tiles_x * heads_q * batches;
    int linear = blockIdx.x, pass = 0;
    __shared__ int sched[2];
    auto tile_of = [&](int lin, int& nb, int& hh, int& bb) {
        if constexpr (kPersistent) {
            interleaved_tile(interleave & 0xff, lin, tiles_x, heads_q, batches, nb, hh, bb);
        } else {
            interleaved_block(interleave, nb, hh, bb);
        }
    };
    // [bwd persistent] a block done taking tiles: the last one sets the counter back to zero for the next launch
    // (the fences order this block's takes before its count, and every block's before the reset)
    auto done_taking = [&]() {
        if (tid != 0) return;
        __threadfence();
        if (atomicAdd(maps.tiles + 1, 1) == int(gridDim.x) - 1) {
            __threadfence();
            maps.tiles[0] = 0;
            maps.tiles[1] = 0;
        }
    };
    if (kPersistent && linear >= n_tiles) {  // (none: the launcher's grid has at most a block a tile)
        done_taking();
        return;
    }
    // [bwd tma] [bwd persistent] The query tiles copied before this tile's (their buffers alternate: tile j of the
    // block's sequence lands in buffer j & 1, the (j >> 1)-th completion of its mbarrier) and the K / V copies before
    // it.
    int q_base = 0, kv_loads = 0;
    // [bwd tma] A tile's first copies: K and V, the first query tile's Q and dO (one thread, tensor copies), its lse
    // and D (every thread, cp.async; [bwd flow] counted by the buffer's mbarrier). Nothing for a tile no query sees:
    // its loop, which waits on the copies, does not run, and a copy still in flight when the block exits would land in
    // the shared memory of the next block on the SM.
    auto copy_first = [&](int lin) {
        int nb, hh, bb;
        tile_of(lin, nb, hh, bb);
        const BlockInfo<V> nbi(vp, bb, hh, seqlen_q, seqlen_k);
        const TileLoop<V> nq = nbi.template query_loop<kBlockM, kBlockN>(nb);
        if (nq.count <= 0) return;
        const int buf = q_base & 1, mi = nq.tile(0);
        if (tid == 0) {
            mbar_expect_tx(full_kv, 2 * kKVTile * 2);
            tma_load_tile<kHeadDim>(smem_u32(sK), maps.k, full_kv, kBlockN, nb * kBlockN, hh / group, bb);
            tma_load_tile<kHeadDim>(smem_u32(sV), maps.v, full_kv, kBlockN, nb * kBlockN, hh / group, bb);
            mbar_expect_tx(full_q + 8 * buf, 2 * kQTile * 2);
            tma_load_tile<kHeadDim>(smem_u32(sQ + buf * kQTile), maps.q, full_q + 8 * buf, kBlockM, mi * kBlockM, hh,
                                    bb);
            tma_load_tile<kHeadDim>(smem_u32(sdO + buf * kQTile), maps.dout, full_q + 8 * buf, kBlockM, mi * kBlockM,
                                    hh, bb);
        }
        const i64 rows = nbi.row_index(hh, heads_q, seqlen_q, 0);
        load_row_stats_async<kBlockM, kThreads>(sLse + buf * kBlockM, sD + buf * kBlockM, lse + rows, delta + rows,
                                                mi * kBlockM, nbi.len_q, tid);
        if constexpr (kFlow) cp_async_mbar_arrive(full_q + 8 * buf);
        cp_async_commit();
    };
    if constexpr (kTma) {
        if (tid == 0) {  // ([bwd flow] the query buffers' barriers also count each thread's lse and D copies)
            mbar_init(full_kv, 1);
            mbar_init(full_q, kFlow ? 1 + kThreads : 1);
            mbar_init(full_q + 8, kFlow ? 1 + kThreads : 1);
        }
        __syncthreads();
        copy_first(linear);
    }

    for (;;) {  // [bwd persistent] one tile a pass (one pass without kPersistent)
        // [bwd persistent] the next tile taken as this one starts; its index stored (and waited for) only at the end
        int taken = 0;
        if constexpr (kPersistent) {
            if (tid == 0) taken = atomicAdd(maps.tiles, 1) + int(gridDim.x);
        }
        int n_block, h, b;
        tile_of(linear, n_block, h, b);
        const int h_kv = h / group;
        const int n0 = n_block * kBlockN;
        const int key_base = n0 + (kShare ? 0 : wg * 64) + warp_in_wg * 16;  // this warp's fragment rows: + g, + g + 8

        const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
        // keys of a shorter sequence (padding keys' dK, dV are zeroed by the launcher; never in the TMA entry point's
        // padded batches, so never in a persistent launch, whose counter needs every block to the end)
        if (bi.past_keys(n0)) return;
        const int len_q = bi.len_q, len_k = bi.len_k;

        const u16* qg = bi.q_rows(q, b, h, q_sb, q_sh, q_ss);
        const u16* dog = bi.q_rows(dout, b, h, do_sb, do_sh, do_ss);
        const float* lse_row = lse + bi.row_index(h, heads_q, seqlen_q, 0);
        const float* delta_row = delta + bi.row_index(h, heads_q, seqlen_q, 0);
        // The m_count query tiles q_tile(0), q_tile(1), ... hold the queries that see this key tile (causal, window).
        // ([variant mask] a block map's list)
        const TileLoop<V> queries = bi.template query_loop<kBlockM, kBlockN>(n_block);
        const int m_count = queries.count;
        const auto q_tile = [&](int it) { return queries.tile(it); };

        // One query tile: Q, dO, and its rows' lse and D (rows past seqlen_q read as zeros).
        auto load_q_stage = [&](int buf, int mi) {
            load_tile_sw128<kBlockM, kHeadDim, kThreads>(sQ + buf * kQTile, qg, q_ss, mi * kBlockM, len_q, tid);
            load_tile_sw128<kBlockM, kHeadDim, kThreads>(sdO + buf * kQTile, dog, do_ss, mi * kBlockM, len_q, tid);
            load_row_stats_async<kBlockM, kThreads>(sLse + buf * kBlockM, sD + buf * kBlockM, lse_row, delta_row,
                                                    mi * kBlockM, len_q, tid);
            if constexpr (kStagedBias) {  // [variant bias tile] the tile's bias, queries x this block's keys
                load_bias_tile<V, kBlockM, kBlockN, kThreads>(sBias + buf * kBiasTile, bi, mi * kBlockM, n0, seqlen_k,
                                                              tid);
            }
        };

        // Query tile mi's Q and dO into buffer buf (one thread); its lse and D by cp.async (every thread, committed by
        // the caller).
        auto copy_q_stage = [&](int buf, int mi) {
            if (tid == 0) {
                mbar_expect_tx(full_q + 8 * buf, 2 * kQTile * 2);
                tma_load_tile<kHeadDim>(smem_u32(sQ + buf * kQTile), maps.q, full_q + 8 * buf, kBlockM, mi * kBlockM,
                                        h, b);
                tma_load_tile<kHeadDim>(smem_u32(sdO + buf * kQTile), maps.dout, full_q + 8 * buf, kBlockM,
                                        mi * kBlockM, h, b);
            }
            load_row_stats_async<kBlockM, kThreads>(sLse + buf * kBlockM, sD + buf * kBlockM, lse_row, delta_row,
                                                    mi * kBlockM, len_q, tid);
        };

        if constexpr (!kTma) {  // ([bwd tma] copy_first, above or at the end of the block's previous tile)
            const u16* kg = k + b * k_sb + h_kv * k_sh + (i64)bi.k0 * k_ss;
            const u16* vg = v + b * v_sb + h_kv * v_sh + (i64)bi.k0 * v_ss;
            load_tile_sw128<kBlockN, kHeadDim, kThreads>(sK, kg, k_ss, n0, len_k, tid);
            load_tile_sw128<kBlockN, kHeadDim, kThreads>(sV, vg, v_ss, n0, len_k, tid);
            if (0 < m_count) load_q_stage(0, q_tile(0));
            cp_async_commit();
        }

        // Descriptors (layouts in hopper_tiles.cuh). K-major operands advance 32 bytes per k16 step inside a
        // 64-column block; MN-major operands advance 2048 bytes (16 rows of the reduction dim) per k16 step.
        const u32 k_addr = smem_u32(sK), v_addr = smem_u32(sV), q_addr = smem_u32(sQ), do_addr = smem_u32(sdO);
        // A of S^T / dP^T: this warpgroup's 64 rows of K / V.
        // ([bwd shared keys] all 64 rows, both warpgroups)
        auto desc_kv = [&](u32 base, int kk) {
            return sw128_desc(base + (kShare ? 0 : wg * 64 * 128) + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32, 16,
                              1024);
        };
        // B of S^T / dP^T: the kBlockM rows of Q / dO, K-major ([bwd shared keys] this warpgroup's kSN of them).
        auto desc_qk = [&](u32 base, int kk) {
            return sw128_desc(base + (kShare ? wg * Cfg::kSN * 128 : 0) + (kk >> 2) * kBlockM * 128 + (kk & 3) * 32,
                              16, 1024);
        };
        // B of dV / dK: dO / Q read as (queries x d), MN-major ([bwd shared keys] from this warpgroup's first column
        // block).
        auto desc_qmn = [&](u32 base, int kk) {
            return sw128_desc(base + (kShare ? wg * (Cfg::kDN / 64) * kBlockM * 128 : 0) + kk * 2048, kBlockM * 128,
                              1024);
        };
        // [bwd shared keys] A of dV / dK: P^T / dS^T from shared memory (keys x queries, K-major: one column block)
        auto desc_kq = [&](u32 base, int kk) { return sw128_desc(base + kk * 32, 16, 1024); };
        // dQ: A = dS^T read as dS (queries x keys), MN-major (M = 64: one column block, LBO unused);
        // B = K read as (keys x d), MN-major, from this warpgroup's first dQ column.
        constexpr int kDqKT = kBlockN / 16;
        const int dq_col0 = Cfg::kDqRowSplit ? 0 : wg * Cfg::kDqN;
        // ([bwd rows 128] A: this warpgroup's 64 queries, a column block of dS^T)
        const u32 ds_wg = Cfg::kDqRowSplit ? wg * kBlockN * 128 : 0;
        auto desc_ds = [&](u32 base, int kk) { return sw128_desc(base + ds_wg + kk * 2048, kBlockN * 128, 1024); };
        auto desc_kmn = [&](int col, int kk) {
            return sw128_desc(k_addr + (col >> 6) * kBlockN * 128 + (col & 63) * 2 + kk * 2048, kBlockN * 128, 1024);
        };

        float dk_acc[kDT][4], dv_acc[kDT][4];
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;
        }
        const float scale_log2 = scale * kLog2e;
        // ([bwd dq tile] planes of whole tiles: rows padded to a multiple of 64; the TMA entry point takes no packed
        // rows)
        float* dqg = !Has_dQ ? nullptr
                     : kDqTile ? dq_accum + ((i64)b * heads_q + h) * ((seqlen_q + kBlockM - 1) / kBlockM * kBlockM) *
                                                 kHeadDim
                               : dq_accum + bi.row_index(h, heads_q, seqlen_q, 0) * kHeadDim;

        for (int it = 0; it < m_count; ++it) {
            const int mi = q_tile(it);
            const int buf = (q_base + it) & 1;
            const int m0 = mi * kBlockM;
            const u32 tq = q_addr + buf * kQTile * 2, tdo = do_addr + buf * kQTile * 2;
            // ([bwd shared keys] this warpgroup's queries: its kSN columns of S^T from m0s, their lse and D)
            const int m0s = m0 + (kShare ? wg * Cfg::kSN : 0);
            const float* tLse = sLse + buf * kBlockM + (m0s - m0);
            const float* tD = sD + buf * kBlockM + (m0s - m0);

            // This tile's stage (and, the first time, K and V) landed and is visible to the tensor cores;
            // every warpgroup is done with the previous tile (its wgmma retired), so buf ^ 1 and dS^T (and [bwd shared
            // keys] P^T) are free.
            // [bwd flow] Not this barrier: the stage's mbarrier counts its lse and D copies too, the next copies wait
            // for dS^T's barrier below (next_stage), and dS^T alternates between two buffers.
            if constexpr (!kFlow) {
                cp_async_wait<0>();
                fence_proxy_async();
                __syncthreads();
            }
            u16* const sds = kFlow && buf ? sdSt2 : sdSt;  // ([bwd flow] this tile's dS^T buffer)
            const u32 ds_addr = smem_u32(sds);
            if constexpr (kTma) {  // [bwd tma] (the barrier above: every wgmma that read buffer buf ^ 1 has retired;
                                   // [bwd flow] copies into buf ^ 1 in next_stage instead)
                if (it == 0) mbar_wait(full_kv, kv_loads & 1);
                mbar_wait(full_q + 8 * buf, ((q_base + it) >> 1) & 1);
                if (!kFlow && it + 1 < m_count) copy_q_stage(buf ^ 1, q_tile(it + 1));
            } else {
                if (it + 1 < m_count) load_q_stage(buf ^ 1, q_tile(it + 1));
            }
            cp_async_commit();

            // [bwd 1] S^T = K Q^T and [bwd 3] dP^T = V dO^T, both in flight at once.
            float st[kNT][4], dpt[kNT][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kKT; ++kk) {
                Wgmma<T>::ss(st, desc_kv(k_addr, kk), desc_qk(tq, kk), kk > 0 ? 1 : 0, Int<Cfg::kSN>());
            }
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < kKT; ++kk) {
                Wgmma<T>::ss(dpt, desc_kv(v_addr, kk), desc_qk(tdo, kk), kk > 0 ? 1 : 0, Int<Cfg::kSN>());
            }
            wgmma_commit();
            // [variant dropout] The keep bits of the tile (indices only), drawn while the tensor cores work; P^T and
            // dP^T both use them.
            u32 keep_bits[V::Has_dropout ? (4 * kNT + 31) / 32 : 1];
            if constexpr (V::Has_dropout) {
                dropout_bits<true, kNT>(keep_bits, bi, key_base, m0s, lane);
                keep_fence(keep_bits);
            }

            // [bwd 1] P^T = exp(scale mod(K Q^T) - lse) while dP^T runs. A row that saw no key has lse = -inf:
            // its P here is +inf, but every tile it meets crosses an edge of its band and is masked to 0 below.
            wgmma_wait<1>();
            fence_regs(st);
            u32 dmod[V::Has_grad ? kNT : 1][2];  // [variant grad] d mod / d s
            if constexpr (kStagedBias) {  // [variant mod] with the staged bias ([variant bias tile])
                const BiasTile<V, kBlockN> bt{sBias + buf * kBiasTile, m0, n0};  // (never [bwd shared keys])
                if constexpr (V::Has_grad) {
                    mod_scores_grad<true>(st, dmod, bi, key_base, m0s, lane, queries.partial(it), bt);
                } else {
                    mod_scores<true>(st, bi, key_base, m0s, lane, queries.partial(it), bt);
                }
            } else if constexpr (V::Has_grad) {
                mod_scores_grad<true>(st, dmod, bi, key_base, m0s, lane, queries.partial(it));
            } else {
                mod_scores<true>(st, bi, key_base, m0s, lane, queries.partial(it));  // [variant mod]
            }
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const float2 l2 = *reinterpret_cast<const float2*>(tLse + nt * 8 + 2 * t);
                const float nl0 = bi.neg_lse_log2(l2.x), nl1 = bi.neg_lse_log2(l2.y);
#pragma unroll
                for (int e = 0; e < 4; ++e) st[nt][e] = fast_exp2(fmaf(st[nt][e], scale_log2, e & 1 ? nl1 : nl0));
            }
            const bool mask_mod = queries.mask_mod_in_mask(it);  // [variant mask]
            if (bi.needs_mask(m0, kBlockM, n0, kBlockN) || mask_mod) {
                mask_block<true>(st, bi, key_base, m0s, lane, 0.f, mask_mod);
            }
            // P^T in the input dtype as A fragments (as it enters dV, and as dS^T uses it). [variant dropout]
            // dV takes P^T dropped (its 1 / (1 - p) applied to dV once, at the end), dS^T the dropped dP^T.
            u32 pt[kSMT][4];
#pragma unroll
            for (int kk = 0; kk < kSMT; ++kk) c_to_a<T, kNT>(pt[kk], st, kk);
            u32 ptd[V::Has_dropout ? kSMT : 1][4];
            if constexpr (V::Has_dropout) {
#pragma unroll
                for (int kk = 0; kk < kSMT; ++kk) dropout_pairs<kNT>(ptd[kk], pt[kk], keep_bits, kk);
            }

            // [bwd 4] dS^T = P^T (dP^T - D), in place of dP^T, then packed to the input dtype.
            wgmma_wait<0>();
            fence_regs(dpt);
#pragma unroll
            for (int kk = 0; kk < kSMT; ++kk) {
#pragma unroll
                for (int hn = 0; hn < 2; ++hn) {
                    const int nt = 2 * kk + hn;
                    const float2 d2 = *reinterpret_cast<const float2*>(tD + nt * 8 + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 w = pt[kk][2 * hn + (e >> 1)];
                        const float p = Elem<T>::to_float(static_cast<u16>(e & 1 ? w >> 16 : w & 0xffffu));
                        float dp = dpt[nt][e];
                        if constexpr (V::Has_dropout) dp = kept<kNT>(keep_bits, nt, e) ? dp * bi.keep_scale : 0.f;
                        dpt[nt][e] = p * (dp - (e & 1 ? d2.y : d2.x));
                    }
                }
            }
            // [variant grad] dbias = dS (the bias is added after softcap), then dS times softcap's derivative.
            if constexpr (V::Has_bias) {
                for_each_score<true>(dpt, key_base, m0s, lane, [&](float& x, int qi, int kj, int nt, int e) {
                    // (a score_mod comes after the bias: its derivative is in dbias)
                    if constexpr (V::Mod::Has_score_mod) {
                        bi.store_dbias(qi, kj, x * grad_at(dmod, nt, e));
                    } else {
                        bi.store_dbias(qi, kj, x);
                    }
                });
            }
            if constexpr (V::Has_grad) {
                for_each_score<true>(dpt, 0, 0, lane,
                                     [&](float& x, int, int, int nt, int e) { x *= grad_at(dmod, nt, e); });
            }
            u32 dst[kSMT][4];
#pragma unroll
            for (int kk = 0; kk < kSMT; ++kk) c_to_a<T, kNT>(dst[kk], dpt, kk);

            // [bwd shared keys] P^T's tile of this tile (its buffer alternates as dS^T's)
            u16* const spt = kFlow && buf ? sPt2 : sPt;
            const u32 pt_addr = smem_u32(spt);
            if constexpr (Has_dQ || kShare) {
                // [bwd 5] dQ += dS K, part 1: dS^T to shared memory (row = key, 32-bit stores: the 8 rows of a store
                // phase hit 8 different 16-byte chunks, conflict-free), visible to the tensor cores of both
                // warpgroups after the proxy fence and the barrier below. Stored before dK's wgmma is issued:
                // the PTX ISA leaves any access to an in-flight wgmma's A registers undefined. [bwd shared keys]
                // P^T too (dropped under dropout, as dV takes it), each warpgroup its kSN query columns: dV's and
                // dK's products read both warpgroups' halves from here.
                const int r = (kShare ? 0 : wg * 64) + warp_in_wg * 16 + g, c0 = kShare ? wg * (Cfg::kSN / 8) : 0;
                auto store_a = [&](u16* tile, const u32 (&a)[kSMT][4]) {
#pragma unroll
                    for (int kk = 0; kk < kSMT; ++kk) {
                        const int c = c0 + 2 * kk;
                        *reinterpret_cast<u32*>(tile + sw128_offset<kBlockN>(r, c) + 2 * t) = a[kk][0];
                        *reinterpret_cast<u32*>(tile + sw128_offset<kBlockN>(r + 8, c) + 2 * t) = a[kk][1];
                        *reinterpret_cast<u32*>(tile + sw128_offset<kBlockN>(r, c + 1) + 2 * t) = a[kk][2];
                        *reinterpret_cast<u32*>(tile + sw128_offset<kBlockN>(r + 8, c + 1) + 2 * t) = a[kk][3];
                    }
                };
                store_a(sds, dst);
                if constexpr (kShare) {
                    if constexpr (V::Has_dropout) {
                        store_a(spt, ptd);
                    } else {
                        store_a(spt, pt);
                    }
                }
                fence_proxy_async();
            }

            // [bwd 2] dV += P^T dO and [bwd 6] dK += dS^T Q (scale applied once at the end), A from registers
            // (the caller fenced the registers: wgmma_fence).
            // [bwd shared keys] A from shared memory, both warpgroups' P^T and dS^T (after the barrier that follows
            // their stores), B this warpgroup's kDN columns of dO and Q.
            // [bwd shared keys] dV's and dK's products apart (A from shared memory)
            auto issue_dv_share = [&]() {
                if constexpr (kShare) {
#pragma unroll
                    for (int kk = 0; kk < kMT; ++kk) {
                        WgmmaTT<T>::ss_tb(dv_acc, desc_kq(pt_addr, kk), desc_qmn(tdo, kk), 1, Int<Cfg::kDN>());
                    }
                    wgmma_commit();
                }
            };
            auto issue_dk_share = [&]() {
                if constexpr (kShare) {
#pragma unroll
                    for (int kk = 0; kk < kMT; ++kk) {
                        WgmmaTT<T>::ss_tb(dk_acc, desc_kq(ds_addr, kk), desc_qmn(tq, kk), 1, Int<Cfg::kDN>());
                    }
                    wgmma_commit();
                }
            };
            auto issue_dv_dk = [&]() {
                if constexpr (kShare) {
                    issue_dv_share();
                    issue_dk_share();
                } else {
#pragma unroll
                    for (int kk = 0; kk < kMT; ++kk) {
                        if constexpr (V::Has_dropout) {
                            Wgmma<T>::rs_tb(dv_acc, ptd[kk], desc_qmn(tdo, kk), 1, Int<Cfg::kDN>());
                        } else {
                            Wgmma<T>::rs_tb(dv_acc, pt[kk], desc_qmn(tdo, kk), 1, Int<Cfg::kDN>());
                        }
                    }
                    wgmma_commit();
#pragma unroll
                    for (int kk = 0; kk < kMT; ++kk) {
                        Wgmma<T>::rs_tb(dk_acc, dst[kk], desc_qmn(tq, kk), 1, Int<Cfg::kDN>());
                    }
                    wgmma_commit();
                }
            };
            // [bwd 5] part 2: dS K, kDqChunk columns from col0, once every warpgroup's dS^T is in shared memory; then
            // this warp's 16 query rows (+ g, + g + 8) of the warpgroup's 64 x kDqChunk slice added into dQ.
            auto issue_dq = [&](float (&dq)[kDqChunk / 8][4], int col0) {
#pragma unroll
                for (int kk = 0; kk < kDqKT; ++kk) {
                    WgmmaTT<T>::ss_tt(dq, desc_ds(ds_addr, kk), desc_kmn(col0, kk), kk > 0 ? 1 : 0, Int<kDqChunk>());
                }
                wgmma_commit();
            };
            auto add_dq = [&](float (&dq)[kDqChunk / 8][4], int col0) {
                if constexpr (kDqTile) {  // [bwd dq tile] this thread's accumulators, contiguous, chunks rotated
                    float* st = sDq + tid * (kDqChunk / 2);
#pragma unroll
                    for (int dt = 0; dt < kDqChunk / 8; ++dt) {
                        *reinterpret_cast<float4*>(st + dq_tile_slot<kDqChunk / 8>(tid, dt) * 4) =
                            make_float4(dq[dt][0], dq[dt][1], dq[dt][2], dq[dt][3]);
                    }
                } else {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int r = warp_in_wg * 16 + g + 8 * hh;
                        if (m0 + r < len_q) {
                            float* dqr = dqg + (i64)(m0 + r) * kHeadDim + col0 + 2 * t;
#pragma unroll
                            for (int dt = 0; dt < kDqChunk / 8; ++dt) {
                                red_add_v2_f32(dqr + dt * 8, dq[dt][2 * hh], dq[dt][2 * hh + 1]);
                            }
                        }
                    }
                }
            };

            // [bwd flow] The next tile's copies, after dS^T's barrier: every warp past it is done with the previous
            // tile, whose buffer they overwrite.
            auto next_stage = [&]() {
                if constexpr (kFlow) {
                    if (it + 1 < m_count) {
                        copy_q_stage(buf ^ 1, q_tile(it + 1));
                        cp_async_mbar_arrive(full_q + 8 * (buf ^ 1));
                    }
                }
            };

            if constexpr (Has_dQ) {
                if constexpr (kDqTile) {  // [bwd dq tile] the tile is free once the last tile's reduction has read it
                    if (tid == kDqIssuer) bulk_wait_read<0>();
                }
                if constexpr (kDqFirst) {
                    // [bwd dq first] dQ's product issued first, then dV's and dK's; this tile's dQ is added while they
                    // run (wait_group 2: the two younger groups, dV and dK, stay in flight).
                    __syncthreads();
                    next_stage();
                    float dq[kDqChunk / 8][4];
                    wgmma_fence();
                    issue_dq(dq, dq_col0);
                    issue_dv_dk();
                    wgmma_wait<2>();
                    fence_regs(dq);
                    add_dq(dq, dq_col0);
                    if constexpr (kDqTile) {
                        // [bwd dq tile] every thread's stores visible to the bulk copy, then one thread adds the tile
                        // (rows past seqlen_q add zeros into the plane's padding: their dO, D and lse are zeros)
                        // (a barrier instruction is a whole warp's: the issuer's warp waits, the others arrive)
                        fence_proxy_async();
                        if (tid / 32 == kDqIssuer / 32) {
                            named_bar_sync(1, kThreads);
                            if (tid == kDqIssuer) {
                                bulk_reduce_add_f32(dqg + (i64)m0 * kHeadDim, smem_u32(sDq), kBlockM * kHeadDim * 4);
                                bulk_commit();
                            }
                        } else {
                            named_bar_arrive(1, kThreads);
                        }
                    }
                    wgmma_wait<0>();
                } else if constexpr (kShare && CUFLASH_BWD_SHARE_DQ) {
                    // [bwd share dq] after the barrier (dV's, dK's and dQ's products read both warpgroups' tiles): a
                    // chunk of dQ added under each of dV's and dK's products
                    static_assert(Cfg::kDqN == 2 * kDqChunk, "[bwd share dq]: two dQ chunks");
                    __syncthreads();
                    next_stage();
                    float dq[kDqChunk / 8][4];
                    wgmma_fence();
                    issue_dq(dq, dq_col0);
                    issue_dv_share();
                    wgmma_wait<1>();
                    fence_regs(dq);
                    add_dq(dq, dq_col0);
                    wgmma_fence();
                    issue_dq(dq, dq_col0 + kDqChunk);
                    issue_dk_share();
                    wgmma_wait<1>();
                    fence_regs(dq);
                    add_dq(dq, dq_col0 + kDqChunk);
                    wgmma_wait<0>();
                } else {
                    if constexpr (kShare) {
                        // [bwd shared keys] dV's and dK's products read both warpgroups' P^T and dS^T: after the
                        // barrier
                        __syncthreads();
                        next_stage();
                        wgmma_fence();
                        issue_dv_dk();
                    } else {
                        wgmma_fence();
                        issue_dv_dk();
                        __syncthreads();
                        next_stage();
                    }
                    // At most 64 columns at a time (32 accumulator registers): a 128-column slice (one warpgroup
                    // at d = 128) would spill next to dK and dV.
#pragma unroll
                    for (int c = 0; c < Cfg::kDqN / kDqChunk; ++c) {
                        float dq[kDqChunk / 8][4];
                        wgmma_fence();
                        issue_dq(dq, dq_col0 + c * kDqChunk);
                        wgmma_wait<0>();
                        fence_regs(dq);
                        add_dq(dq, dq_col0 + c * kDqChunk);
                    }
                }
            } else {
                if constexpr (kShare) __syncthreads();  // [bwd shared keys] every warpgroup's P^T and dS^T stored
                wgmma_fence();
                issue_dv_dk();
                wgmma_wait<0>();
            }
        }
        cp_async_wait<0>();
        fence_regs(dk_acc);
        fence_regs(dv_acc);
        q_base += m_count;
        kv_loads += m_count > 0;
        if constexpr (kPersistent) {
            // [bwd persistent] the next tile's first copies, under this tile's stores of dK and dV: every warp is past
            // its last products (their wgmma retired), so K, V and the query buffers are free.
            if (tid == 0) sched[pass & 1] = taken;
            __syncthreads();
            linear = sched[pass & 1];
            ++pass;
            if (linear < n_tiles) copy_first(linear);
        }

        // Write dK = scale * dK_acc and dV: straight to dk/dv (group == 1) or per query head to the float32
        // workspace that flash_bwd_reduce_dkv_kernel sums over the group. [variant dropout] dV times 1 / (1 - p).
        if constexpr (V::Has_dropout) {
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dv_acc[dt][e] *= bi.keep_scale;
            }
        }
        const int qk8 = bi.template qk_cols8<kHeadDim>(), v8 = bi.template v_cols8<kHeadDim>();  // [bwd tma pad]
        const int dt0 = kShare ? wg * kDT : 0;  // ([bwd shared keys] this warpgroup's columns: n8 fragment dt0 on)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = key_base + g + 8 * hh;
            if (row >= len_k) continue;
            const int col0 = 8 * dt0 + 2 * t;
            if (group == 1) {
                u16* dkr = dk + b * dk_sb + h * dk_sh + (i64)(bi.k0 + row) * dk_ss + col0;
                u16* dvr = dv + b * dv_sb + h * dv_sh + (i64)(bi.k0 + row) * dv_ss + col0;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    if (!V::Pads_head_dim || dt0 + dt < qk8) {  // [bwd tma pad] the arrays' columns only
                        *reinterpret_cast<u32*>(dkr + dt * 8) =
                            Elem<T>::pack(dk_acc[dt][2 * hh] * scale, dk_acc[dt][2 * hh + 1] * scale);
                    }
                    if (!V::Pads_head_dim || dt0 + dt < v8) {
                        *reinterpret_cast<u32*>(dvr + dt * 8) =
                            Elem<T>::pack(dv_acc[dt][2 * hh], dv_acc[dt][2 * hh + 1]);
                    }
                }
            } else {
                // (the workspace's batch: [bwd persistent]'s grid is one-dimensional)
                const i64 plane = (i64)(V::Is_varlen ? 1 : kPersistent ? batches : gridDim.z) * heads_q * seqlen_k *
                                  kHeadDim;
                float* dkr = dkv_accum + bi.key_row_index(h, heads_q, seqlen_k, row) * kHeadDim + col0;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    *reinterpret_cast<float2*>(dkr + dt * 8) =
                        make_float2(dk_acc[dt][2 * hh] * scale, dk_acc[dt][2 * hh + 1] * scale);
                    *reinterpret_cast<float2*>(dkr + plane + dt * 8) =
                        make_float2(dv_acc[dt][2 * hh], dv_acc[dt][2 * hh + 1]);
                }
            }
        }
        if (!kPersistent || linear >= n_tiles) break;
    }  // (the tiles' loop)
    if constexpr (kPersistent) done_taking();  // (its last take, past the tiles, was in its last pass)
    if constexpr (kDqTile) {
        if (tid == kDqIssuer) bulk_wait<0>();  // [bwd dq tile] (the dQ tile stays while the last reduction reads it)
    }
}

// flash_bwd_dkdv_sm90's entry points: the launcher's (VariantParams by value) and the flat one
// (CUFLASH_VARIANT_FLAT_PARAMS)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_sm90_kernel(CUFLASH_BWD_DKDV_PARAMS, const VariantParams vp) {
    flash_bwd_dkdv_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, Has_dQ>(CUFLASH_BWD_DKDV_ARGS, vp);
}
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_sm90_flat_kernel(CUFLASH_BWD_DKDV_PARAMS, CUFLASH_VARIANT_FLAT_PARAMS) {
    flash_bwd_dkdv_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, Has_dQ>(CUFLASH_BWD_DKDV_ARGS,
                                                                                    CUFLASH_VARIANT_FLAT_ARGS);
}
// ... and the TMA one ([bwd tma]), with [bwd persistent]'s tile counter (unused without kPersistent) and the tensor
// maps of q, k, v and dO after the launcher's parameters.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ,
          bool kPersistent = false>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_sm90_tma_kernel(CUFLASH_BWD_DKDV_PARAMS, const VariantParams vp, int* tile_counter,
                               const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                               const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap do_map) {
    flash_bwd_dkdv_sm90<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, Has_dQ, true, kPersistent>(
        CUFLASH_BWD_DKDV_ARGS, vp, BwdMaps{&q_map, &k_map, &v_map, &do_map, tile_counter});
}

// [bwd dq tile] dQ = scale * dq_accum, cast, from the workspace that the TMA entry point fills in fragment order
// (planes of (seqlen_q rounded up to kRows) x kHeadDim floats, each kRows-row tile in dq_tile_pos's order): a block
// copies one tile into shared memory as it lies (coalesced) and writes its rows in order; dq has the first `cols`
// columns. Grid (ceil(seqlen_q / kRows), heads_q, batch), 256 threads. kRows: the dK/dV launch's query tile (64, or
// [bwd rows 128] 128).
template <class T, int kHeadDim, int kRows>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dq_tiles_kernel(const float* __restrict__ dq_accum, u16* __restrict__ dq, int seqlen_q, int heads_q,
                                  i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale, int cols) {
    constexpr int kTile = kRows * kHeadDim;
    __shared__ __align__(16) float tile[kTile];
    const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
    const i64 rows = (seqlen_q + kRows - 1) / kRows * kRows;
    const float4* src = reinterpret_cast<const float4*>(dq_accum + (((i64)b * heads_q + h) * rows + m0) * kHeadDim);
    for (int i = threadIdx.x; i < kTile / 4; i += 256) reinterpret_cast<float4*>(tile)[i] = src[i];
    __syncthreads();
    // eight columns a thread: one 16-byte store where the row's eight lie whole and aligned, else pair by pair
    for (int e = threadIdx.x; e < kTile / 8; e += 256) {
        const int r = e / (kHeadDim / 8), c = 8 * (e % (kHeadDim / 8));
        if (m0 + r >= seqlen_q || c >= cols) continue;
        u16* dst = dq + b * dq_sb + h * dq_sh + (i64)(m0 + r) * dq_ss + c;
        u32 packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 x = *reinterpret_cast<const float2*>(tile + dq_tile_pos<kHeadDim, kRows>(r, c + 2 * j));
            packed[j] = Elem<T>::pack(x.x * scale, x.y * scale);
        }
        if (c + 8 <= cols && ((unsigned long long)dst & 15) == 0) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (c + 2 * j < cols) *reinterpret_cast<u32*>(dst + 2 * j) = packed[j];
        }
    }
}

}  // namespace cuflash
