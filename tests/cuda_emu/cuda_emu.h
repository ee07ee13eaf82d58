// CPU emulation of the small part of CUDA C++ the rawpaged kernels use, so the real cuda/*.cu sources run
// under g++ (tests/test_cuda_emulated.py). Model:
//   * one std::thread per CUDA thread of a block; the blocks of a grid run one after another, each thread
//     looping over them (so threads are created once per launch);
//   * __syncthreads() is a barrier over the block's threads that have not exited; a thread returning from
//     the kernel drops out of its block and warp barriers (CUDA: exited threads no longer count);
//   * warp shuffles go through a per-warp exchange buffer: write own value, warp barrier, read the source
//     lane's value; two buffers alternate so one barrier per shuffle suffices (a buffer is rewritten only
//     after every lane passed the next shuffle's barrier, i.e. after all reads of it);
//   * __shared__ variables are function statics (one copy, blocks run in sequence); dynamic shared memory is
//     a per-launch buffer refilled with 0xFF (NaN for floats) before every block and fenced by guard bytes
//     that are checked after the launch;
//   * __half / __nv_bfloat16 come from NVIDIA's real cuda_fp16.h / cuda_bf16.h (host code paths), with the
//     two nvcc-only headers they need stubbed in shim/.
// Limits (by design): shuffle masks are ignored and lanes are not lock-step, so a shuffle under lane
// divergence deadlocks instead of misbehaving quietly; timings mean nothing.
#pragma once
#define RP_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace emu {

// Barrier whose participant count shrinks when a thread exits. The last arriver optionally runs a
// completion step before anyone is released.
class Barrier {
   public:
    void reset(int n) {
        std::lock_guard<std::mutex> lk(mu_);
        expected_ = n;
        arrived_ = 0;
    }
    void wait(const std::function<void()>* on_complete = nullptr) {
        std::unique_lock<std::mutex> lk(mu_);
        const unsigned long long gen = gen_;
        if (++arrived_ >= expected_) {
            if (on_complete) (*on_complete)();
            release();
            return;
        }
        cv_.wait(lk, [&] { return gen_ != gen; });
    }
    void drop() {
        std::lock_guard<std::mutex> lk(mu_);
        --expected_;
        if (arrived_ > 0 && arrived_ >= expected_) release();
    }

   private:
    void release() {
        arrived_ = 0;
        ++gen_;
        cv_.notify_all();
    }
    std::mutex mu_;
    std::condition_variable cv_;
    int expected_ = 0;
    int arrived_ = 0;
    unsigned long long gen_ = 0;
};

struct Warp {
    Barrier bar;
    unsigned long long buf[2][32];
};

struct Block {
    Barrier bar;
    std::vector<std::unique_ptr<Warp>> warps;
    unsigned char* smem = nullptr;
};

inline thread_local uint3 tl_threadIdx;
inline thread_local uint3 tl_blockIdx;
inline thread_local dim3 tl_blockDim;
inline thread_local dim3 tl_gridDim;
inline thread_local Warp* tl_warp = nullptr;
inline thread_local Block* tl_block = nullptr;
inline thread_local int tl_lane = 0;
inline thread_local int tl_phase = 0;

inline void* dynamic_smem() { return tl_block->smem; }
inline void syncthreads() { tl_block->bar.wait(); }
inline void syncwarp() { tl_warp->bar.wait(); }

template <class T>
inline T shfl_from(T v, int src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type over 8 bytes");
    Warp* w = tl_warp;
    const int ph = tl_phase;
    tl_phase ^= 1;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w->buf[ph][tl_lane] = bits;
    w->bar.wait();
    bits = w->buf[ph][src];
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

constexpr size_t SMEM_GUARD = 64;
constexpr unsigned char GUARD_BYTE = 0xA5;

using Launcher = std::function<int(dim3, dim3, size_t, void**)>;

// Runs kernel k over the grid; params[i] points to the i-th argument (as in cuLaunchKernel).
// Returns 0, or -3 when the kernel wrote outside its dynamic shared memory.
template <class... A, size_t... I>
int run_kernel(void (*k)(A...), dim3 grid, dim3 block, size_t smem_bytes, void** params,
               std::index_sequence<I...>) {
    const std::tuple<std::decay_t<A>...> args(*static_cast<std::decay_t<A>*>(params[I])...);
    const int nthreads = (int)(block.x * block.y * block.z);
    const long long nblocks = (long long)grid.x * grid.y * grid.z;
    Block blk;
    const int nwarps = (nthreads + 31) / 32;
    for (int w = 0; w < nwarps; ++w) blk.warps.emplace_back(new Warp());
    std::vector<unsigned char> smem(smem_bytes + 2 * SMEM_GUARD + 16);
    unsigned char* base = smem.data() + (16 - reinterpret_cast<size_t>(smem.data()) % 16) % 16;
    std::memset(base, GUARD_BYTE, SMEM_GUARD);
    std::memset(base + SMEM_GUARD + smem_bytes, GUARD_BYTE, SMEM_GUARD);
    blk.smem = base + SMEM_GUARD;
    const std::function<void()> reset = [&] {
        blk.bar.reset(nthreads);
        for (int w = 0; w < nwarps; ++w) blk.warps[w]->bar.reset(std::min(32, nthreads - 32 * w));
        std::memset(blk.smem, 0xFF, smem_bytes);
    };
    reset();
    Barrier end_of_block;
    end_of_block.reset(nthreads);
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (int tid = 0; tid < nthreads; ++tid) {
        threads.emplace_back([&, tid] {
            tl_blockDim = block;
            tl_gridDim = grid;
            tl_threadIdx = make_uint3(tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y));
            tl_lane = tid % 32;
            tl_warp = blk.warps[tid / 32].get();
            tl_block = &blk;
            for (long long b = 0; b < nblocks; ++b) {
                tl_blockIdx = make_uint3((unsigned)(b % grid.x), (unsigned)((b / grid.x) % grid.y),
                                         (unsigned)(b / ((long long)grid.x * grid.y)));
                tl_phase = 0;
                std::apply(k, args);
                blk.bar.drop();
                tl_warp->bar.drop();
                end_of_block.wait(&reset);
            }
        });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < SMEM_GUARD; ++i)
        if (base[i] != GUARD_BYTE || base[SMEM_GUARD + smem_bytes + i] != GUARD_BYTE) return -3;
    return 0;
}

template <class T>
constexpr size_t pointee_size() {
    if constexpr (std::is_pointer<T>::value) {
        return sizeof(std::remove_cv_t<std::remove_pointer_t<T>>);
    } else {
        return 0;
    }
}

struct Entry {
    Launcher launch;
    std::vector<size_t> sizes;     // sizeof each parameter
    std::vector<size_t> pointees;  // sizeof the pointed-to element for pointer parameters, else 0
    std::string kinds;  // per parameter: 'p' pointer, 'i' signed integer, 'u' unsigned integer, 'f' float
};

inline std::map<std::string, Entry>& registry() {
    static std::map<std::string, Entry> r;
    return r;
}

template <class T>
constexpr char kind_of() {
    return std::is_pointer<T>::value ? 'p' : std::is_floating_point<T>::value ? 'f'
                                         : std::is_signed<T>::value           ? 'i'
                                                                              : 'u';
}

template <class... A>
bool reg(const char* name, void (*k)(A...)) {
    Entry e;
    e.launch = [k](dim3 g, dim3 b, size_t smem, void** params) {
        return run_kernel(k, g, b, smem, params, std::index_sequence_for<A...>{});
    };
    e.sizes = {sizeof(std::decay_t<A>)...};
    e.pointees = {pointee_size<std::decay_t<A>>()...};
    e.kinds = std::string{kind_of<std::decay_t<A>>()...};
    registry()[name] = std::move(e);
    return true;
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------- CUDA names
#define threadIdx (::emu::tl_threadIdx)
#define blockIdx (::emu::tl_blockIdx)
#define blockDim (::emu::tl_blockDim)
#define gridDim (::emu::tl_gridDim)
#define warpSize 32
#define __shared__ static
#define __launch_bounds__(...)
#define __syncthreads() ::emu::syncthreads()

inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::syncwarp(); }

template <class T>
inline T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    const int lane = ::emu::tl_lane;
    return ::emu::shfl_from(v, (lane & ~(width - 1)) | (src_lane & (width - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    const int lane = ::emu::tl_lane;
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return ::emu::shfl_from(v, src);
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = ::emu::tl_lane;
    const int src = lane + (int)delta;
    return ::emu::shfl_from(v, src < ((lane & ~(width - 1)) + width) ? src : lane);
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = ::emu::tl_lane;
    const int src = lane - (int)delta;
    return ::emu::shfl_from(v, src >= (lane & ~(width - 1)) ? src : lane);
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
// The block's threads are real threads: atomics are the compiler's (returns the old value, as CUDA's).
inline int atomicAdd(int* address, int v) { return __atomic_fetch_add(address, v, __ATOMIC_RELAXED); }

// C entry points for ctypes (defined in exactly one translation unit of the library).
#ifdef EMU_DEFINE_API
extern "C" {
int emu_num_kernels() { return (int)emu::registry().size(); }
const char* emu_kernel_name(int i) {
    auto it = emu::registry().begin();
    std::advance(it, i);
    return it->first.c_str();
}
// Parameter sizes, pointee sizes and kinds of a kernel; returns the parameter count, or -1 for an unknown
// name.
int emu_param_info(const char* name, int max_params, unsigned long long* sizes, unsigned long long* pointees,
                   char* kinds) {
    auto it = emu::registry().find(name);
    if (it == emu::registry().end()) return -1;
    const int n = (int)it->second.sizes.size();
    for (int i = 0; i < n && i < max_params; ++i) {
        sizes[i] = it->second.sizes[i];
        pointees[i] = it->second.pointees[i];
        kinds[i] = it->second.kinds[i];
    }
    return n;
}
// 0 on success, -1 unknown kernel, -2 wrong parameter count, -3 dynamic shared memory overrun.
int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
               unsigned long long smem_bytes, void** params, int nparams) {
    auto it = emu::registry().find(name);
    if (it == emu::registry().end()) return -1;
    if (nparams != (int)it->second.sizes.size()) return -2;
    return it->second.launch(dim3(gx, gy, gz), dim3(bx, by, bz), (size_t)smem_bytes, params);
}
}
#endif
