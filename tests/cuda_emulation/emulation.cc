// Runtime of the host emulation (see emulation.h). cudaLaunchKernel runs the blocks of a
// launch one after another (x fastest); the threads of a block are fibers on the calling OS thread,
// switched round-robin whenever one waits at a shuffle, so a run is deterministic and cheap.
// Shuffles meet at a per-warp gate keyed by their mask; dynamic shared memory is a static
// buffer refilled with NaN before every block (and, under AddressSanitizer, poisoned past the
// launch's size). EmuRun is the C entry point used by tests/test_cuda_emulated.py (ctypes).
//
// x86-64 System V only (the fiber switch is a few lines of assembly).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "emulation.h"
#include "gpu/nbhd_attn_kernels.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace s2attn {
namespace gpu {
// What DynamicShared() in nbhd_attn_device.cuh declares; 48 KiB as on the device.
constexpr size_t kSharedCapacity = 48 * 1024;
alignas(16) float s2attn_dynamic_shared[kSharedCapacity / sizeof(float)];
}  // namespace gpu
}  // namespace s2attn

// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save, and resumes the context whose stack pointer is `resume`.
extern "C" void EmuSwitch(void** save, void* resume);
asm(R"(
  .text
  .globl EmuSwitch
  .type EmuSwitch, @function
EmuSwitch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size EmuSwitch, .-EmuSwitch
)");

namespace {

constexpr size_t kFiberStackBytes = 256 * 1024;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s (block %u,%u,%u, thread %u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x);
  std::fflush(stderr);
  std::abort();
}

struct Fiber {
  std::unique_ptr<char[]> stack{new char[kFiberStackBytes]};
  void* sp = nullptr;
  unsigned thread = 0;
  bool done = false;
  void* asan_fake_stack = nullptr;
};

// One launch's scheduler state (launches never nest).
struct Scheduler {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  void* scheduler_sp = nullptr;
  void (*kernel)(s2attn::NbhdAttnGpuParams) = nullptr;
  s2attn::NbhdAttnGpuParams params;
  uint64_t progress = 0;  // bumped whenever a fiber gets past a wait
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
};
Scheduler g_scheduler;

void SwitchToScheduler(bool dying) {
  Fiber* self = g_scheduler.current;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(dying ? nullptr : &self->asan_fake_stack, g_scheduler.scheduler_stack_bottom,
                                 g_scheduler.scheduler_stack_size);
#endif
  EmuSwitch(&self->sp, g_scheduler.scheduler_sp);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(self->asan_fake_stack, nullptr, nullptr);
#endif
  (void)dying;
}

void FiberMain() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_scheduler.scheduler_stack_bottom, &g_scheduler.scheduler_stack_size);
#endif
  g_scheduler.kernel(g_scheduler.params);
  g_scheduler.current->done = true;
  SwitchToScheduler(/*dying=*/true);
  Fail("a finished fiber was resumed");
}

// Prepares `f` so that switching to it enters FiberMain on a fresh stack.
void ResetFiber(Fiber& f, unsigned thread) {
  f.thread = thread;
  f.done = false;
  f.asan_fake_stack = nullptr;
  auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kFiberStackBytes) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<uint64_t*>(top) - 9;  // control words, 6 registers, return address, pad
  slots[0] = 0x1F80u | (uint64_t{0x037Fu} << 32);     // default MXCSR, x87 control word
  for (int i = 1; i <= 6; ++i) slots[i] = 0;
  slots[7] = reinterpret_cast<uint64_t>(&FiberMain);  // EmuSwitch's `ret` lands here, rsp = 8 mod 16
  slots[8] = 0;
  f.sp = slots;
}

// The lanes of one warp; lanes named by one shuffle mask meet at the gate of that mask.
// Slots are double-buffered by the gate's generation, so one meeting per shuffle suffices:
// a lane can only write the buffer of generation g + 2 after everyone passed generation g + 1,
// i.e. after every reader of generation g has read.
struct Warp {
  float slots[2][32] = {};
  std::map<unsigned, std::pair<int, uint64_t>> gates;  // mask -> (arrived, generation)
};
std::vector<Warp> g_warps;
cudaError_t g_last_error = cudaSuccess;

}  // namespace

namespace {

float Shuffle(unsigned mask, float value, unsigned source, int width) {
  const unsigned lane = threadIdx.x % 32;
  if (width != 32) Fail("shuffle: only width 32 is emulated");
  if (source >= 32 || !((mask >> lane) & 1u) || !((mask >> source) & 1u)) {
    Fail("shuffle: lane or source lane not in the mask");
  }
  Warp& warp = g_warps[threadIdx.x / 32];
  auto& gate = warp.gates[mask];
  const uint64_t generation = gate.second;
  float* slots = warp.slots[generation % 2];
  slots[lane] = value;
  if (++gate.first == __builtin_popcount(mask)) {
    gate.first = 0;
    ++gate.second;
  } else {
    while (gate.second == generation) SwitchToScheduler(/*dying=*/false);
  }
  ++g_scheduler.progress;
  return slots[source];
}

}  // namespace

float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width) {
  return Shuffle(mask, value, (threadIdx.x % 32) ^ static_cast<unsigned>(lane_mask), width);
}

float __shfl_sync(unsigned mask, float value, int src_lane, int width) {
  return Shuffle(mask, value, static_cast<unsigned>(src_lane), width);
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t error = g_last_error;
  g_last_error = cudaSuccess;
  return error;
}

cudaError_t CUDARTAPI cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                                       cudaStream_t /*stream*/) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      block.x == 0 || block.x > 1024 || block.x % 32 != 0 || block.y != 1 || block.z != 1) {
    return g_last_error = cudaErrorInvalidConfiguration;
  }
  if (shared_bytes > s2attn::gpu::kSharedCapacity) return g_last_error = cudaErrorInvalidValue;
  // Every kernel of cuda/gpu takes one NbhdAttnGpuParams by value.
  g_scheduler.kernel = reinterpret_cast<void (*)(s2attn::NbhdAttnGpuParams)>(const_cast<void*>(func));
  g_scheduler.params = *static_cast<const s2attn::NbhdAttnGpuParams*>(args[0]);
  g_scheduler.fibers.resize(block.x);
  blockDim = block;
  gridDim = grid;
  float* shared = s2attn::gpu::s2attn_dynamic_shared;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  for (uint64_t b = 0; b < blocks; ++b) {  // x fastest, as the hardware starts them
    blockIdx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / grid.x / grid.y)};
    // Garbage in, so that reading unwritten shared memory shows up as NaN.
#if EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(shared, s2attn::gpu::kSharedCapacity);
#endif
    for (size_t i = 0; i < shared_bytes / sizeof(float); ++i) shared[i] = std::numeric_limits<float>::quiet_NaN();
#if EMU_ASAN
    ASAN_POISON_MEMORY_REGION(reinterpret_cast<char*>(shared) + shared_bytes,
                              s2attn::gpu::kSharedCapacity - shared_bytes);
#endif
    g_warps.assign(block.x / 32, Warp{});
    for (unsigned t = 0; t < block.x; ++t) ResetFiber(g_scheduler.fibers[t], t);
    // Round-robin until every fiber finished; a full round without progress is a deadlock.
    for (unsigned live = block.x; live > 0;) {
      const uint64_t progress_before = g_scheduler.progress;
      live = 0;
      for (Fiber& f : g_scheduler.fibers) {
        if (f.done) continue;
        g_scheduler.current = &f;
        threadIdx = uint3{f.thread, 0, 0};
#if EMU_ASAN
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f.stack.get(), kFiberStackBytes);
#endif
        EmuSwitch(&g_scheduler.scheduler_sp, f.sp);
#if EMU_ASAN
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
        if (!f.done) ++live;
        if (f.done) ++g_scheduler.progress;
      }
      if (live > 0 && g_scheduler.progress == progress_before) {
        Fail("deadlock: every live thread waits at a shuffle that not all lanes of its mask reach");
      }
    }
  }
#if EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(shared, s2attn::gpu::kSharedCapacity);
#endif
  return cudaSuccess;
}

// target: 0 forward (results out, lse), 1 dq (dq), 2 dkv (dk, dv). sizes: batch, heads, dk,
// dv, nq_lat, nq_lon, nk_lat, nk_lon, nlat_q, nlon_q, nlat_k, nlon_k, residues, shift, num_arcs.
// Returns the launcher's cudaError_t.
extern "C" int EmuRun(int target, int dtype, const void* q, const void* k, const void* v, const void* dout,
                      const float* lse, const float* delta, const int32_t* window, const int32_t* row_order,
                      const int32_t* arc_offsets, const int32_t* arcs, const float* quad_weights, float* result0,
                      float* result1, const int64_t* sizes, float scale) {
  s2attn::NbhdAttnGpuParams p;
  p.dtype = static_cast<s2attn::ActivationType>(dtype);
  p.q = q;
  p.k = k;
  p.v = v;
  p.dout = dout;
  p.lse = lse;
  p.delta = delta;
  p.window = window;
  p.row_order = row_order;
  p.arc_offsets = arc_offsets;
  p.arcs = arcs;
  p.quad_weights = quad_weights;
  p.batch = sizes[0];
  p.heads = sizes[1];
  p.head_dim_k = sizes[2];
  p.head_dim_v = sizes[3];
  p.nq_lat = static_cast<int32_t>(sizes[4]);
  p.nq_lon = static_cast<int32_t>(sizes[5]);
  p.nk_lat = static_cast<int32_t>(sizes[6]);
  p.nk_lon = static_cast<int32_t>(sizes[7]);
  p.nlat_q = static_cast<int32_t>(sizes[8]);
  p.nlon_q = static_cast<int32_t>(sizes[9]);
  p.nlat_k = static_cast<int32_t>(sizes[10]);
  p.nlon_k = static_cast<int32_t>(sizes[11]);
  p.residues = static_cast<int32_t>(sizes[12]);
  p.shift = static_cast<int32_t>(sizes[13]);
  p.num_arcs = sizes[14];
  p.scale = scale;
  switch (target) {
    case 0:
      p.out = result0;
      p.lse_out = result1;
      return s2attn::LaunchNbhdAttnFwd(nullptr, p);
    case 1:
      p.dq = result0;
      return s2attn::LaunchNbhdAttnBwdDq(nullptr, p);
    case 2:
      p.dk = result0;
      p.dv = result1;
      return s2attn::LaunchNbhdAttnBwdDkv(nullptr, p);
    default:
      return cudaErrorInvalidValue;
  }
}
