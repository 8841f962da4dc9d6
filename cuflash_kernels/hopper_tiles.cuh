// cuflash Hopper (sm_90a) primitives for forward_sm90.cu and backward_sm90.cu: wgmma wrappers,
// shared-memory matrix descriptors for the 128-byte-swizzled layout, cp.async tile copies into that
// layout, and the proxy fence that orders them. Header-only and free of CUDA toolkit headers (NVRTC needs no include
// path), like cuflash_tiles.cuh, which it extends and which must be included first (the launcher inlines
// only the includes of the top-level source file).
//
// The 128-byte-swizzled layout (PTX ISA "Shared Memory Matrix Layout", swizzle mode 128B): a tile of
// R rows x W 16-bit columns (W a multiple of 64) is stored as W / 64 column blocks of R x 64, each row of
// a block 128 bytes; 16-byte chunk c (8 elements) of row r sits at chunk position c ^ (r % 8) of that
// row. Eight rows (1024 bytes) are one swizzle atom; the hardware applies the XOR to absolute address
// bits [4:6] ^ [7:9], so every tile starts at a multiple of 1024 bytes.
//   - K-major operand (Q and K in S = Q K^T: rows are M or N, columns are the reduction dim d):
//     descriptor start = block base + 32 bytes per k16 step inside a 64-column block; stride byte
//     offset (SBO) = 1024 (8-row groups); leading byte offset unused (1).
//   - MN-major operand (V in O = P V, rows are the reduction dim = keys, columns are N = d), with the
//     transpose bit: start = block 0 + 2048 bytes per k16 step (16 rows); SBO = 1024 (8-key groups);
//     LBO = R * 128 bytes (from one 64-column block of d to the next).
// wgmma accumulator layout (m64nNk16, per warp w of the warpgroup, rows 16 w .. 16 w + 15): the N / 8
// fragments d[j][0..3] are exactly mma.sync m16n8 C fragments of n8 tile j, and the A-from-registers
// operand is exactly an mma.sync m16n8k16 A fragment, so cuflash_tiles.cuh's masking, softmax and
// C -> A repacking apply unchanged.
#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "hopper_tiles.cuh needs the sm_90a target (wgmma): compile with -arch=sm_90a"
#endif

namespace cuflash {

typedef unsigned long long u64;

template <int N> struct Int {};

// Element (r, chunk c) of a 128-byte-swizzled R x W tile, in elements from the tile base.
template <int kRows>
__device__ __forceinline__ int sw128_offset(int r, int c) {
    return (c >> 3) * (kRows * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// Copy rows [row0, row0 + kRows) of a (rows, kWidth) global matrix (row stride `stride` elements) into a
// 128-byte-swizzled tile with 16-byte cp.async; rows at or past `nrows` become zeros. Consecutive
// threads take consecutive chunks of a row: coalesced reads, conflict-free 8-thread store phases.
template <int kRows, int kWidth, int kThreads>
__device__ __forceinline__ void load_tile_sw128(u16* tile, const u16* g, i64 stride, int row0, int nrows, int tid) {
    static_assert(kWidth % 64 == 0, "128-byte swizzle needs 64-element column blocks");
    constexpr int kChunks = kWidth / 8;
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int i = tid + it * kThreads;
        if (kTotal % kThreads != 0 && i >= kTotal) break;
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = row0 + r < nrows;
        const u16* src = valid ? g + (i64)(row0 + r) * stride + c * 8 : g;
        cp_async_16(smem_u32(tile + sw128_offset<kRows>(r, c)), src, valid);
    }
}

// The same copy with a rolled loop, for a producer warpgroup that holds few registers (setmaxnreg):
// one source pointer and one destination offset live at a time.
template <int kRows, int kWidth, int kThreads>
__device__ __forceinline__ void load_tile_sw128_lean(u16* tile, const u16* g, i64 stride, int row0, int nrows, int tid) {
    static_assert(kWidth % 64 == 0, "128-byte swizzle needs 64-element column blocks");
    constexpr int kChunks = kWidth / 8;
    constexpr int kTotal = kRows * kChunks;
#pragma unroll 1
    for (int i = tid; i < kTotal; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = row0 + r < nrows;
        const u16* src = valid ? g + (i64)(row0 + r) * stride + c * 8 : g;
        cp_async_16(smem_u32(tile + sw128_offset<kRows>(r, c)), src, valid);
    }
}

// Shared-memory matrix descriptor, 128-byte swizzle (mode 1 in bits 62-63), base offset 0.
__device__ __forceinline__ u64 sw128_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)(lbo_bytes >> 4) << 16) | ((u64)(sbo_bytes >> 4) << 32) |
           (1ull << 62);
}

// Ordinary (generic-proxy) shared-memory writes, cp.async included, become visible to wgmma (async
// proxy) only after this fence in each writing thread, followed by a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// After wgmma_wait: tie the accumulator registers to this point, so that no read of them is scheduled
// before the wait (the asm statements of the wgmma are the registers' last writers as the compiler sees it).
template <int kN>
__device__ __forceinline__ void fence_regs(float (&d)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e]) :: "memory");
    }
}
template <int kN>
__device__ __forceinline__ void fence_regs(u32 (&a)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e]) :: "memory");
    }
}

// ---------------------------------------------------------------------------------------------------
// mbarriers (shared memory, CTA scope) for the warp-specialized kernel: a producer warpgroup signals
// "tile landed" (after its cp.async completed and a proxy fence), consumers signal "buffer free".
__device__ __forceinline__ void mbar_init(u32 addr, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 addr) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(addr) : "memory");
}
// Wait until the phase with the given parity (0 or 1) has completed.
__device__ __forceinline__ void mbar_wait(u32 addr, int parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    } while (!done);
}

// ---------------------------------------------------------------------------------------------------
// Tensor memory access (TMA): a CUtensorMap (cuTensorMapEncodeTiled's 128 bytes, 64-byte aligned; cuflash/_cuda/
// tensor_map.py), passed as a __grid_constant__ parameter, and one thread's copy of a box into shared memory that
// completes on an mbarrier (which the thread told first how many bytes to expect: every box delivers all its bytes,
// zeros past the tensor's edges).
struct alignas(64) TensorMap {
    u64 bits[16];
};

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// The box at coordinates (c0 innermost, c1, c2, c3) of a 4-d map into shared memory at dst.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                 "[%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}

// A tile of `rows` rows of a map, at `row` of (head, batch), into shared memory at dst in the 128-byte swizzle: kCols /
// kBoxCols boxes of kBoxCols columns (128 bytes: 64 16-bit elements, 128 e4m3, 32 float32) from column `col`, each
// column block `rows` x 128 bytes after the one before (the wgmma descriptors' layout), landing on `bar`, which the
// caller told the bytes first.
template <int kCols, int kBoxCols = 64>
__device__ __forceinline__ void tma_load_tile(u32 dst, const TensorMap* map, u32 bar, int rows, int row, int head,
                                              int batch, int col = 0) {
#pragma unroll
    for (int c = 0; c < kCols / kBoxCols; ++c) {
        tma_load_4d(dst + c * rows * 128, map, bar, col + c * kBoxCols, row, head, batch);
    }
}

// The mbarrier at addr counts one arrival of this thread once all its earlier cp.async copies have landed (.noinc:
// the barrier's expected count, set at init, includes these arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 addr) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(addr) : "memory");
}

// Bulk reduction (no tensor map): `bytes` (a multiple of 16) of float32 at shared-memory address src added into
// global memory at dst (both 16-byte aligned), element by element in L2, as one asynchronous copy of this thread's
// bulk group; the thread commits its group, then waits for its groups' reads of shared memory (before it or its warp
// writes there again) or for their completion.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// Named barriers over some warps of the block (id 0 is __syncthreads; count: threads, a multiple of 32).
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// An arrival that orders this thread's earlier accesses before the waiters' later ones. CUFLASH_RACECHECK (the
// CUFLASH_RACECHECK=1 build, docs/testing.md): a wait as well, the same order, which compute-sanitizer's racecheck
// follows (it reports every access handed over by a bar.arrive as a hazard)
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
#ifdef CUFLASH_RACECHECK
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
#else
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
#endif
}

// Move registers between warpgroups (needs a register cap at kernel entry: __launch_bounds__(n, 1)).
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}

// wgmma.mma_async m64nNk16, float32 accumulators d[N / 8][4] (see the layout note above).
//   ss:    D (+)= A B^T, A (64 x 16) and B (N x 16) K-major in shared memory (descriptors da, db).
//   rs_tb: D (+)= A B,   A (64 x 16) from registers (an mma.sync A fragment per warp), B (16 x N)
//          MN-major in shared memory (transpose bit set).
// scale_d = 0 overwrites D, 1 accumulates. Generated for N = 64, 128, 192, 256 (ss also 32: MLA decoding; 80: d 256's
// forward on 80-key tiles, FlashAttention-3's). The
// wrappers are written once for the PTX type TY of A and B ("f16" or "bf16", the only difference between the two
// specializations); a macro, because an asm string must be a literal.
template <class T> struct Wgmma;

#define CUFLASH_WGMMA_OPS(TY) \
    __device__ __forceinline__ static void ss(float (&d)[4][4], u64 da, u64 db, int scale_d, Int<32>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15" \
                     "}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss(float (&d)[8][4], u64 da, u64 db, int scale_d, Int<64>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31" \
                     "}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss(float (&d)[10][4], u64 da, u64 db, int scale_d, Int<80>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n80k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39" \
                     "}, %40, %41, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void rs_tb(float (&d)[8][4], const u32 (&a)[4], u64 db, int scale_d, Int<64>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31" \
                     "}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss(float (&d)[16][4], u64 da, u64 db, int scale_d, Int<128>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63" \
                     "}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void rs_tb(float (&d)[16][4], const u32 (&a)[4], u64 db, int scale_d, Int<128>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63" \
                     "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss(float (&d)[24][4], u64 da, u64 db, int scale_d, Int<192>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95" \
                     "}, %96, %97, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
                     "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
                     "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
                     "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
                     "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void rs_tb(float (&d)[24][4], const u32 (&a)[4], u64 db, int scale_d, Int<192>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95" \
                     "}, {%96,%97,%98,%99}, %100, p, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
                     "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
                     "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
                     "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
                     "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss(float (&d)[32][4], u64 da, u64 db, int scale_d, Int<256>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127" \
                     "}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
                     "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
                     "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
                     "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
                     "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), \
                     "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), \
                     "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), \
                     "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
                     "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void rs_tb(float (&d)[32][4], const u32 (&a)[4], u64 db, int scale_d, Int<256>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127" \
                     "}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
                     "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
                     "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
                     "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
                     "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), \
                     "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), \
                     "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), \
                     "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
                     "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)); \
    }

template <> struct Wgmma<fp16> { CUFLASH_WGMMA_OPS("f16") };
template <> struct Wgmma<bf16> { CUFLASH_WGMMA_OPS("bf16") };

// ---------------------------------------------------------------------------------------------------
// FP8 (e4m3) for forward_sm90.cu's [fp8] path. The element tag; wgmma m64nNk32 with e4m3 A and B (both K-major: 8-bit
// wgmma has no transpose), float32 accumulators in the layout above:
//   ss: D (+)= A B^T, A (64 x 32) and B (N x 32) K-major in shared memory (descriptors); N = 128 (S = Q K^T).
//   rs: D (+)= A B,   A (64 x 32) from registers, B (32 x N) K-major (stored N x 32: V^T); N = d, 128 or 256.
// The A-from-registers fragment of k32 is an mma.sync m16n8k32 8-bit A fragment per warp: register 0 holds row g's
// k 4t .. 4t + 3 (low byte first), 1 row g + 8's, 2 and 3 the same rows' k 16 + 4t .. 16 + 4t + 3 (g = lane / 4,
// t = lane % 4). Element offsets in a 128-byte-swizzled fp8 tile are the 16-bit tile's byte offsets: a k32 step is
// 32 bytes, four to a 128-byte block, as a k16 step of 16-bit elements.
struct e4m3 {};

template <> struct Wgmma<e4m3> {
    __device__ __forceinline__ static void ss(float (&d)[16][4], u64 da, u64 db, int scale_d, Int<128>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                     "}, %64, %65, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "l"(da), "l"(db), "r"(scale_d));
    }
    __device__ __forceinline__ static void rs(float (&d)[16][4], const u32 (&a)[4], u64 db, int scale_d, Int<128>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                     "}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
    __device__ __forceinline__ static void rs(float (&d)[32][4], const u32 (&a)[4], u64 db, int scale_d, Int<256>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
                     "}, {%128,%129,%130,%131}, %132, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
};

// Four floats to e4m3 (round to nearest even, saturating to +-448), a0 in the low byte.
__device__ __forceinline__ u32 pack_e4m3x4(float a0, float a1, float a2, float a3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(a1), "f"(a0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(a3), "f"(a2));
    return (u32)lo | ((u32)hi << 16);
}

// [fp8 p] P of score fragments (N = 32 * kPT keys) to the e4m3 A fragment of k32 step kk. The accumulator gives a
// thread keys 2t, 2t + 1 of each n8 tile; the fragment wants k 4t .. 4t + 3. Rather than exchange values between
// lanes, register j takes the thread's own keys of tiles 4 kk + 2 (j / 2) and 4 kk + 2 (j / 2) + 1: the fragment's k
// = 16 h + 4t + i (h = 0, 1; i = 0..3) holds key 16 h + 2t + (i & 1) + 8 (i >> 1) of the step's 32. P V sums over
// keys, so V^T's columns carry the same order (vt_key, which transpose_v_kernel writes; cuflash/_cuda/vt.py's
// KEY_ORDER).
template <int kNT>
__device__ __forceinline__ void p_to_e4m3(u32 (&a)[4], const float (&s)[kNT][4], int kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = 4 * kk + 2 * h;
        a[2 * h] = pack_e4m3x4(s[n][0], s[n][1], s[n + 1][0], s[n + 1][1]);
        a[2 * h + 1] = pack_e4m3x4(s[n][2], s[n][3], s[n + 1][2], s[n + 1][3]);
    }
}

// ---------------------------------------------------------------------------------------------------
// TF32 for forward_sm90.cu's [tf32] path (float32 inputs, fp32_precision="tf32"): wgmma m64nNk8 with tf32 A and B
// (K-major only, as e4m3), float32 bits read as tf32 (the low 13 mantissa bits ignored). ss N = 64, 128 (S = Q K^T,
// 64- or 128-key tiles); rs N = d, 64 or 128. The A-from-registers fragment of k8: register 0 holds row g's k t, 1 row
// g + 8's, 2 and 3 the same rows' k t + 4. (The element tag tf32: cuflash_tiles.cuh.)
template <> struct Wgmma<tf32> {
    __device__ __forceinline__ static void ss(float (&d)[16][4], u64 da, u64 db, int scale_d, Int<128>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                     "}, %64, %65, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "l"(da), "l"(db), "r"(scale_d));
    }
    __device__ __forceinline__ static void ss(float (&d)[8][4], u64 da, u64 db, int scale_d, Int<64>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
                     "}, %32, %33, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "l"(da), "l"(db), "r"(scale_d));
    }
    __device__ __forceinline__ static void rs(float (&d)[8][4], const u32 (&a)[4], u64 db, int scale_d, Int<64>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
                     "}, {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
    __device__ __forceinline__ static void rs(float (&d)[16][4], const u32 (&a)[4], u64 db, int scale_d, Int<128>) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
                     "}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    }
};

// [vt p] P of one n8 tile of scores to the tf32 A fragment of k8 step kk (rounded to TF32), without exchanging values
// between lanes: the thread's keys 2t, 2t + 1 become the fragment's k t, t + 4 (registers 0, 1 and 2, 3), so V^T's 8
// keys of the step are stored in the order 0, 2, 4, 6, 1, 3, 5, 7 (vt_key).
template <int kNT>
__device__ __forceinline__ void p_to_tf32(u32 (&a)[4], const float (&s)[kNT][4], int kk) {
    a[0] = tf32_round(s[kk][0]);
    a[1] = tf32_round(s[kk][2]);
    a[2] = tf32_round(s[kk][1]);
    a[3] = tf32_round(s[kk][3]);
}

// Element policies of the Hopper forward (forward_sm90.cu): bytes per element; the k of one wgmma (32 bytes of each
// operand row: 16 16-bit elements, 32 e4m3, 8 tf32); the wgmma's element type (Mma); whether V is read as V^T (8-bit
// and tf32 wgmma read B K-major only: [fp8], [tf32]), and then the keys of one P fragment's group in V^T (kVtGroup)
// and the key that position p of a group holds ([vt p]: vt_key, the order p_to_e4m3 / p_to_tf32 pack P in and
// transpose_v_kernel writes); whether each operand is two fp16 parts ([f16x2]: kSplit); [fp8 p]'s offset of P (log2);
// the output's element.
template <class T> struct Sm90Elem {  // fp16, bf16: V read MN-major (the transpose bit)
    static constexpr int kBytes = 2;
    static constexpr int kKStep = 16;
    using Mma = T;
    static constexpr bool kVt = false;
    static constexpr bool kSplit = false;
    static constexpr int kPOff = 0;
    using Out = T;
};
template <> struct Sm90Elem<e4m3> {
    static constexpr int kBytes = 1;
    static constexpr int kKStep = 32;
    using Mma = e4m3;
    static constexpr bool kVt = true;
    static constexpr int kVtGroup = 16;  // (two k32 halves' 8 of p_to_e4m3)
    __device__ __forceinline__ static int vt_key(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }
    static constexpr bool kSplit = false;
    static constexpr int kPOff = 8;
    using Out = bf16;
};
template <> struct Sm90Elem<tf32> {
    static constexpr int kBytes = 4;
    static constexpr int kKStep = 8;
    using Mma = tf32;
    static constexpr bool kVt = true;
    static constexpr int kVtGroup = 8;  // (one k8 step of p_to_tf32)
    __device__ __forceinline__ static int vt_key(int p) { return 2 * (p & 3) + (p >> 2); }
    static constexpr bool kSplit = false;
    static constexpr int kPOff = 0;
    using Out = float;
};
// [f16x2] float32 q, k, v as pairs of fp16 parts (split_f16x2_kernel): a row of d "elements" of 4 bytes is the d fp16
// high parts, then the d low parts, so a tile's 64-column blocks hold the high parts first, the low parts after, each
// block read by fp16 wgmma (k16 steps). P is split in registers at 2^14 its value (kPOff: below fp16's largest
// power of two, its low part above fp16's subnormals); O leaves as float32.
template <> struct Sm90Elem<f16x2> {
    static constexpr int kBytes = 4;
    static constexpr int kKStep = 16;
    using Mma = fp16;
    static constexpr bool kVt = false;
    static constexpr bool kSplit = true;
    static constexpr int kPOff = 14;
    using Out = float;
};

// [f16x2] P of k16 step kk (keys 16 kk .. 16 kk + 15 of a score block, as c_to_a packs them) as two fp16 A fragments:
// hi = P rounded to fp16, lo = (P - hi) rounded to fp16 (P - hi is exact in float32).
template <int kNT>
__device__ __forceinline__ void p_to_f16x2(u32 (&hi)[4], u32 (&lo)[4], const float (&s)[kNT][4], int kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float x = s[2 * kk + (i >> 1)][2 * (i & 1)], y = s[2 * kk + (i >> 1)][2 * (i & 1) + 1];
        hi[i] = Elem<fp16>::pack(x, y);
        lo[i] = Elem<fp16>::pack(x - Elem<fp16>::to_float(u16(hi[i] & 0xffffu)),
                                 y - Elem<fp16>::to_float(u16(hi[i] >> 16)));
    }
}

// [f16x2] The power of two 2^e that split_f16x2_kernel multiplies a tensor by before splitting it, from the bits of
// its largest magnitude (absmax_f32_kernel's): the largest scaled value below 2^14 (fp16's high part and its low
// part, 2^-11 of it, both normal numbers for values near the largest); 1 for a tensor of zeros or with a NaN or an
// infinity. e in [-120, 120], so that 2^e and 2^-e are normal float32 numbers.
__device__ __forceinline__ int f16x2_exponent(u32 max_bits) {
    const float m = __uint_as_float(max_bits);
    if (!(m > 0.f) || m == CUFLASH_INF) return 0;
    const int e = max(int(max_bits >> 23), 1) - 126;  // m < 2^e (m's biased exponent; a subnormal m: 2^-126)
    return min(max(14 - e, -120), 120);
}
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((127 + e) << 23); }

// ---------------------------------------------------------------------------------------------------
// For backward_sm90.cu.

// wgmma.mma_async m64nNk16 with both operands MN-major in shared memory (both transpose bits set):
//   D (+)= A B, A (64 x 16) stored K-rows-contiguous-in-M (a tile whose rows are the reduction dim, e.g.
//   dS^T[key][query] read as dS), B (16 x N) stored as rows of the reduction dim (e.g. K[key][d]).
// Descriptors as the MN-major operand of hopper_tiles.cuh's layout note: start + 2048 bytes per k16 step,
// SBO = 1024 (8-row groups of the reduction dim), LBO = the distance between 64-column blocks.
// PTX ISA: the transpose immediates are valid for .f16 / .bf16 only. Generated for N = 32, 64, 128, written
// once for both types as Wgmma's wrappers are. ss_tb (N = 128): A K-major, B MN-major, both in shared memory (the
// shared-keys backward's dV += P^T dO and dK += dS^T Q, P^T and dS^T from shared memory).
template <class T> struct WgmmaTT;
#define CUFLASH_WGMMA_TT_OPS(TY) \
    __device__ __forceinline__ static void ss_tt(float (&d)[4][4], u64 da, u64 db, int scale_d, Int<32>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15" \
                     "}, %16, %17, p, 1, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss_tt(float (&d)[8][4], u64 da, u64 db, int scale_d, Int<64>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31" \
                     "}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss_tt(float (&d)[16][4], u64 da, u64 db, int scale_d, Int<128>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63" \
                     "}, %64, %65, p, 1, 1, 1, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    } \
    __device__ __forceinline__ static void ss_tb(float (&d)[16][4], u64 da, u64 db, int scale_d, Int<128>) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" \
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63" \
                     "}, %64, %65, p, 1, 1, 0, 1;\n}\n" \
                     : \
                     "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                     "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                     "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                     "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                     "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                     "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                     "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                     "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                     : "l"(da), "l"(db), "r"(scale_d)); \
    }

template <> struct WgmmaTT<fp16> { CUFLASH_WGMMA_TT_OPS("f16") };
template <> struct WgmmaTT<bf16> { CUFLASH_WGMMA_TT_OPS("bf16") };

// Two neighbouring float32 values added to global memory in one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v2_f32(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
}
// ... four (16-byte aligned).
__device__ __forceinline__ void red_add_v4_f32(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

}  // namespace cuflash
