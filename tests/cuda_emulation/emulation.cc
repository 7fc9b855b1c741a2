// Runtime of the host emulation (see emulation.h). cudaLaunchKernel runs the blocks of a
// launch one after another (x fastest); the threads of a block are fibers on the calling OS
// thread, switched round-robin whenever one waits at a barrier or a warp collective, so a run
// is deterministic and cheap. Warp collectives (shuffles, votes, __syncwarp, each warp's share of a
// wgmma) meet at a per-warp gate keyed by their mask; __syncthreads at a per-block barrier. Dynamic
// shared memory is a static buffer refilled with NaN before every block (and, under
// AddressSanitizer, poisoned past the launch's size). The C entry points called from Python are
// in run_target.cc (the kernels of cuda/gpu) and primitives_selftest.cu (the self-test).
//
// x86-64 System V only (the fiber switch is a few lines of assembly).
#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "emulation.h"
#include "gpu/cp_async_sm80.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

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
// What DynamicShared() declares: the H200's opt-in maximum per block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), which a kernel gets by cudaFuncSetAttribute.
constexpr size_t kSharedCapacity = 232448;
alignas(1024) float s2attn_dynamic_shared[kSharedCapacity / sizeof(float)];
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
// Dynamic shared memory a launch may use unless cudaFuncSetAttribute raised the kernel's limit.
constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kMaxWgmmaN = 128;  // the widest wgmma the kernels issue (m64n128)

// Aborts the run with a message naming the current block and thread.
[[noreturn]] __attribute__((format(printf, 1, 2))) void Fail(const char* format, ...) {
  std::fprintf(stderr, "cuda emulation: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, " (block %u,%u,%u, thread %u)\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
  std::fflush(stderr);
  std::abort();
}

// A wgmma's result on its way to the issuing thread's accumulator registers `d`: written there by the
// wgmma.wait_group that completes its group (the registers hold NaN in between).
struct PendingWgmma {
  float* d;
  unsigned count;
  float values[kMaxWgmmaN / 2];
};

struct Fiber {
  std::unique_ptr<char[]> stack{new char[kFiberStackBytes]};
  std::vector<PendingWgmma> open_group;                 // issued since the last commit
  std::vector<std::vector<PendingWgmma>> committed;     // oldest first
  void* sp = nullptr;
  unsigned thread = 0;
  bool done = false;
  const char* waiting_at = nullptr;  // what it waits at, for the deadlock report
  bool untracked_copies = false;     // cp.async copies issued since its last CopyAsyncArriveOn
  void* asan_fake_stack = nullptr;
};

// One launch's scheduler state (launches never nest).
struct Scheduler {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  void* scheduler_sp = nullptr;
  std::function<void()> kernel;  // the kernel with its launch's parameters
  size_t shared_bytes = 0;  // the launch's dynamic shared memory
  uint64_t progress = 0;    // bumped whenever a fiber gets past a wait or finishes
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
};
Scheduler g_scheduler;

// cp.async copies are only known to have landed through a barrier that tracks them; a thread that
// synchronises with copies no barrier tracks would hand over a stage that may still be filling.
void CheckCopiesTracked(const char* at) {
  if (g_scheduler.current->untracked_copies) {
    Fail("%s with cp.async copies that no barrier tracks (CopyAsyncArriveOn first)", at);
  }
}

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

// Yields to the other fibers until `passed()` holds; `what` names the wait for a deadlock report.
template <typename Passed>
void WaitUntil(const char* what, Passed&& passed) {
  g_scheduler.current->waiting_at = what;
  while (!passed()) SwitchToScheduler(/*dying=*/false);
  g_scheduler.current->waiting_at = nullptr;
}

// ------------------------------------------------------------------ warp collectives

enum class Collective : uint8_t { kShuffle, kVote, kSyncWarp, kWgmma, kWgmmaF16 };

const char* NameOf(Collective kind) {
  switch (kind) {
    case Collective::kShuffle: return "a shuffle";
    case Collective::kVote: return "a vote";
    case Collective::kSyncWarp: return "__syncwarp";
    case Collective::kWgmma: return "a wgmma";
    case Collective::kWgmmaF16: return "a wgmma (f16)";
  }
  return "?";
}

// What one lane brings to a collective.
union LaneInput {
  uint32_t bits;  // shuffled value, vote predicate
  struct WgmmaIssue {
    uint64_t a_desc, b_desc;  // a_desc 0: A in registers
    uint32_t n, trans_b, accumulate;
    bool operator==(const WgmmaIssue&) const = default;
  };
  struct {
    uint32_t a[4];  // A fragments (register A)
    WgmmaIssue issue;
  } wgmma;
};

// One meeting of the lanes of a mask. At a wgmma the lane that completes the meeting also computes
// what the lanes take from it (the warp's rows of the product), once instead of once per lane.
struct Meeting {
  Collective kind;
  LaneInput lanes[32];
  double rows[16][kMaxWgmmaN];  // wgmma: the warp's 16 rows of A * B
};

// Lanes named by one mask meet at the gate of that mask. Meetings are double-buffered by the
// gate's generation, so one meeting per collective suffices: a lane can only overwrite the
// meeting of generation g (at generation g + 2) after every lane passed generation g + 1, i.e.
// after every lane of generation g took its result.
struct Gate {
  int arrived = 0;
  uint64_t generation = 0;
  Meeting meetings[2];
};

struct Warp {
  Gate full;                         // mask 0xffffffff: every wgmma, most shuffles
  std::map<unsigned, Gate> partial;  // the other masks
  unsigned exited = 0;               // lanes whose thread returned from the kernel

  Gate& GateOf(unsigned mask) { return mask == kFullMask ? full : partial[mask]; }
};
std::vector<Warp> g_warps;

// The block-wide barrier of __syncthreads.
struct BlockBarrier {
  unsigned arrived = 0;
  uint64_t generation = 0;
  unsigned exited = 0;  // threads that returned from the kernel
};
BlockBarrier g_barrier;

cudaError_t g_last_error = cudaSuccess;
std::map<const void*, size_t> g_shared_limits;  // kernel -> limit set by cudaFuncSetAttribute

unsigned Lane() { return threadIdx.x % 32; }

// The 16-bit values of a fragment register (`lo` is the lower column or row).
uint16_t Low(uint32_t reg) { return static_cast<uint16_t>(reg & 0xffffu); }
uint16_t High(uint32_t reg) { return static_cast<uint16_t>(reg >> 16); }

double Widen(Collective kind, uint16_t bits) {
  if (kind == Collective::kWgmma) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

// The 16 x 16 A tile the lanes' fragments `fragments(lane)` hold: a warp's share of wgmma's register A
// (layout: wgmma_sm90.cuh, that of mma.sync's m16n8k16 A fragment).
template <typename Fragments>
void ReadFragmentsA(const Meeting& m, Fragments&& fragments, double (&a)[16][16]) {
  for (unsigned lane = 0; lane < 32; ++lane) {
    const unsigned g = lane / 4, t = lane % 4;
    const uint32_t(&f)[4] = fragments(m.lanes[lane]);
    for (unsigned half = 0; half < 2; ++half) {  // columns 2t + half, 2t + 8 + half
      auto pick = [&](uint32_t reg) { return Widen(m.kind, half ? High(reg) : Low(reg)); };
      a[g][2 * t + half] = pick(f[0]);
      a[g + 8][2 * t + half] = pick(f[1]);
      a[g][2 * t + 8 + half] = pick(f[2]);
      a[g + 8][2 * t + 8 + half] = pick(f[3]);
    }
  }
}

// A tile of wgmma's shared operands (gpu/wgmma_sm90.cuh): rows of `row_bytes` (128 or 64), 8-row atoms `stride`
// bytes apart, the swizzle of that width applied to the address (128 bytes: bits 4-6 XOR bits 7-9; 64: bits 4-5
// XOR bits 7-8), start 16-byte aligned; an MN-major B wider than a row has its columns n j .. n j + n - 1
// (n = row_bytes / 2) `leading` j bytes past the start.
struct SwizzledTile {
  uint32_t start, stride, leading, row_bytes;
};

// Only the forms the scheduled kernels of cuda/gpu use are emulated: the 128- and 64-byte swizzles, no base
// offset, atoms of 8 rows (1024 or 512 bytes) apart, and a start inside the first row of an atom with the slice
// read per row (`slice_bytes`: 32 for a k16 slice of a K-major tile, 2 N for N columns of an MN-major one within a
// row, the whole row for wider ones, which need a leading offset of whole atoms) in it.
SwizzledTile DecodeDescriptor(uint64_t descriptor, uint32_t slice_bytes, bool wide = false) {
  const auto bits = static_cast<unsigned long long>(descriptor);
  const uint64_t mode = descriptor >> 62;
  if (mode != 1 && mode != 2) Fail("wgmma: descriptor %#llx is not of a 128- or 64-byte-swizzled tile", bits);
  if ((descriptor >> 49) & 7) Fail("wgmma: descriptor %#llx has a base offset (not emulated)", bits);
  const uint32_t row_bytes = mode == 1 ? 128 : 64, atom = 8 * row_bytes;
  const SwizzledTile tile{static_cast<uint32_t>(descriptor & 0x3FFF) << 4,
                          static_cast<uint32_t>((descriptor >> 32) & 0x3FFF) << 4,
                          static_cast<uint32_t>((descriptor >> 16) & 0x3FFF) << 4, row_bytes};
  if (tile.stride != atom) Fail("wgmma: descriptor %#llx: atoms %u bytes apart, not %u", bits, tile.stride, atom);
  slice_bytes = std::min(slice_bytes, row_bytes);
  if ((tile.start & (atom - 1) & ~(row_bytes - 1)) != 0 || (tile.start & (row_bytes - 1)) + slice_bytes > row_bytes) {
    Fail("wgmma: descriptor %#llx: a %u-byte slice from byte %u of an atom leaves its first row", bits, slice_bytes,
         tile.start & (atom - 1));
  }
  if (wide && (tile.leading == 0 || tile.leading % atom != 0)) {
    Fail("wgmma: descriptor %#llx: a B wider than a row with its blocks %u bytes apart", bits, tile.leading);
  }
  return tile;
}

// What each warp of the block issued, wgmma by wgmma: the four warps of a warpgroup issue every wgmma
// together on the device (one warpgroup-wide instruction), with the same operands.
std::vector<std::vector<LaneInput::WgmmaIssue>> g_wgmma_issues;

void RecordWgmma(const LaneInput::WgmmaIssue& issue) {
  const unsigned warp = threadIdx.x / 32, first = warp / 4 * 4;
  if ((first + 4) * 32 > blockDim.x) {
    Fail("wgmma: the warpgroup of warp %u (warps %u..%u) is not whole in a block of %u threads", warp, first,
         first + 3, blockDim.x);
  }
  std::vector<LaneInput::WgmmaIssue>& mine = g_wgmma_issues[warp];
  for (unsigned other = first; other < first + 4; ++other) {
    const auto& theirs = g_wgmma_issues[other];
    if (other != warp && theirs.size() > mine.size() && !(theirs[mine.size()] == issue)) {
      Fail("wgmma: wgmma %zu of warp %u differs from warp %u's (descriptors, shape or accumulate)", mine.size(), warp,
           other);
    }
  }
  mine.push_back(issue);
}

// At the end of a block: every warp of a warpgroup issued as many wgmmas as the others.
void CheckWgmmaIssuesComplete() {
  for (size_t warp = 0; warp < g_wgmma_issues.size(); ++warp) {
    const size_t first = warp / 4 * 4;
    if (g_wgmma_issues[warp].size() != g_wgmma_issues[first].size()) {
      Fail("wgmma: warp %zu issued %zu wgmmas, warp %zu of its warpgroup %zu", warp, g_wgmma_issues[warp].size(), first,
           g_wgmma_issues[first].size());
    }
  }
}

// The 16-bit value at (unswizzled) offset `address` of the launch's dynamic shared memory, swizzled over rows of
// `row_bytes` (128 or 64).
uint16_t SwizzledElement(uint32_t address, uint32_t row_bytes) {
  const uint32_t physical = address ^ (((address >> 7) & (row_bytes / 16 - 1)) << 4);
  if (physical + 2 > g_scheduler.shared_bytes) {
    Fail("wgmma: operand address %u past the launch's %zu bytes of dynamic shared memory", physical,
         g_scheduler.shared_bytes);
  }
  uint16_t value;
  std::memcpy(&value, reinterpret_cast<const char*>(s2attn::gpu::s2attn_dynamic_shared) + physical, 2);
  return value;
}

// Element (row, k) of a K-major tile (rows of k: A, or B multiplied against its transpose).
uint16_t KMajor(const SwizzledTile& tile, int row, int k) {
  return SwizzledElement(tile.start + (row / 8) * tile.stride + (row % 8) * tile.row_bytes + 2 * k, tile.row_bytes);
}

// Element (k, n) of an MN-major tile (rows of n, one per k: B multiplied as it is stored; a row's columns a block).
uint16_t MnMajor(const SwizzledTile& tile, int k, int n) {
  const int per_row = static_cast<int>(tile.row_bytes / 2);
  return SwizzledElement(tile.start + (n / per_row) * tile.leading + (k / 8) * tile.stride + (k % 8) * tile.row_bytes +
                             2 * (n % per_row),
                         tile.row_bytes);
}

// The warp's 16 rows of an m64nNk16 product: A (its rows 16 w .. 16 w + 15 of the warpgroup's 64) from
// the lanes' fragments or from shared memory, B (16 x N) from shared memory. Products of 16-bit values are
// exact in double and the 16-term sums nearly so; each lane adds its accumulator in double and rounds once to
// float (the hardware sums in float in an unspecified order, so the emulation is at least as accurate).
void MultiplyWarpRows(Meeting& m) {
  const auto& first = m.lanes[0].wgmma.issue;
  for (unsigned lane = 1; lane < 32; ++lane) {
    if (!(m.lanes[lane].wgmma.issue == first)) {
      Fail("wgmma: lane %u gives other descriptors, shape or accumulate than lane 0", lane);
    }
  }
  RecordWgmma(first);
  const unsigned warp_in_group = threadIdx.x / 32 % 4;
  double a[16][16], b[16][kMaxWgmmaN];
  if (first.a_desc != 0) {
    const SwizzledTile tile = DecodeDescriptor(first.a_desc, 32);
    for (int row = 0; row < 16; ++row) {
      for (int k = 0; k < 16; ++k) a[row][k] = Widen(m.kind, KMajor(tile, 16 * warp_in_group + row, k));
    }
  } else {
    ReadFragmentsA(m, [](const LaneInput& in) -> const uint32_t(&)[4] { return in.wgmma.a; }, a);
  }
  const uint32_t b_row_bytes = first.b_desc >> 62 == 2 ? 64 : 128;
  const bool wide = first.trans_b && 2 * first.n > b_row_bytes;
  const SwizzledTile tile = DecodeDescriptor(first.b_desc, first.trans_b ? 2 * first.n : 32, wide);
  for (int k = 0; k < 16; ++k) {
    for (unsigned n = 0; n < first.n; ++n) {
      b[k][n] = Widen(m.kind, first.trans_b ? MnMajor(tile, k, n) : KMajor(tile, n, k));
    }
  }
  for (int row = 0; row < 16; ++row) {
    for (unsigned n = 0; n < first.n; ++n) {
      double sum = 0.0;
      for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][n];
      m.rows[row][n] = sum;
    }
  }
}

// The calling lane brings `input` to the collective `kind` of the lanes in `mask` and waits
// until all of them have arrived. The meeting returned stays valid until the caller's next
// collective.
const Meeting& Meet(unsigned mask, Collective kind, const LaneInput& input) {
  const unsigned lane = Lane();
  if (!((mask >> lane) & 1u)) Fail("%s: the calling lane is not in the mask %#x", NameOf(kind), mask);
  Warp& warp = g_warps[threadIdx.x / 32];
  if (mask & warp.exited) {
    const int exited_lane = __builtin_ctz(mask & warp.exited);
    Fail("%s: lane %d of the mask %#x already returned from the kernel", NameOf(kind), exited_lane, mask);
  }
  Gate& gate = warp.GateOf(mask);
  const uint64_t generation = gate.generation;
  Meeting& m = gate.meetings[generation % 2];
  if (gate.arrived == 0) {
    m.kind = kind;
  } else if (m.kind != kind) {
    Fail("lanes of the mask %#x meet at different collectives (%s here, %s in another lane)", mask, NameOf(kind),
         NameOf(m.kind));
  }
  m.lanes[lane] = input;
  if (++gate.arrived == __builtin_popcount(mask)) {
    if (kind == Collective::kWgmma || kind == Collective::kWgmmaF16) MultiplyWarpRows(m);
    gate.arrived = 0;
    ++gate.generation;
  } else {
    WaitUntil(NameOf(kind), [&] { return gate.generation != generation; });
  }
  ++g_scheduler.progress;
  return m;
}

// A warp's share of a wgmma needs all 32 lanes (.sync.aligned). A lane that skips one leaves the
// others waiting: that fails when it returns from the kernel or meets them at another kind of
// collective (or as a deadlock); one that makes up for it by an extra call of the same kind
// later goes unnoticed, since call sites are not compared.
const Meeting& MeetWholeWarp(Collective kind, const LaneInput& input) { return Meet(kFullMask, kind, input); }

// `value` of lane `source` (any 32-bit type, moved as bits).
template <typename T>
T Shuffle(unsigned mask, T value, unsigned source, int width) {
  static_assert(sizeof(T) == 4);
  if (width != 32) Fail("shuffle: only width 32 is emulated");
  if (source >= 32 || !((mask >> source) & 1u)) Fail("shuffle: source lane %u not in the mask %#x", source, mask);
  LaneInput input;
  std::memcpy(&input.bits, &value, 4);
  const uint32_t bits = Meet(mask, Collective::kShuffle, input).lanes[source].bits;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The offset of `p` in the launch's dynamic shared memory; fails unless it is `alignment`-aligned there
// and [p, p + bytes) lies inside.
uint32_t SharedOffset(const char* what, const void* p, size_t alignment, size_t bytes) {
  const auto base = reinterpret_cast<uintptr_t>(s2attn::gpu::s2attn_dynamic_shared);
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address < base || address - base + bytes > g_scheduler.shared_bytes) {
    Fail("%s: address %p (%zu bytes) is not inside the launch's %zu bytes of dynamic shared memory", what, p, bytes,
         g_scheduler.shared_bytes);
  }
  if ((address - base) % alignment != 0) Fail("%s: shared address %p is not %zu-byte aligned", what, p, alignment);
  return static_cast<uint32_t>(address - base);
}

// Fails unless [p, p + bytes) is `bytes`-aligned and inside the launch's dynamic shared memory.
void CheckShared(const char* what, const void* p, size_t bytes) { SharedOffset(what, p, bytes, bytes); }

bool InSharedBuffer(const void* p) {
  const auto base = reinterpret_cast<uintptr_t>(s2attn::gpu::s2attn_dynamic_shared);
  const auto address = reinterpret_cast<uintptr_t>(p);
  return address >= base && address - base < s2attn::gpu::kSharedCapacity;
}

// ------------------------------------------------------------------ fibers

// A thread that returns while lanes of its warp or threads of its block wait for it is a bug
// (on hardware a hang or undefined behaviour): fail here, naming what they wait at.
void CheckNobodyWaitsFor(unsigned thread) {
  if (g_barrier.arrived > 0) Fail("returned from the kernel while other threads wait at __syncthreads");
  Warp& warp = g_warps[thread / 32];
  const unsigned lane_bit = 1u << (thread % 32);
  if (warp.full.arrived > 0) {
    Fail("returned from the kernel while other lanes of its warp wait at %s",
         NameOf(warp.full.meetings[warp.full.generation % 2].kind));
  }
  for (const auto& [mask, gate] : warp.partial) {
    if ((mask & lane_bit) && gate.arrived > 0) {
      Fail("returned from the kernel while other lanes of the mask %#x wait at %s", mask,
           NameOf(gate.meetings[gate.generation % 2].kind));
    }
  }
  warp.exited |= lane_bit;
  ++g_barrier.exited;
}

void FiberMain() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_scheduler.scheduler_stack_bottom, &g_scheduler.scheduler_stack_size);
#endif
  g_scheduler.kernel();
  if (!g_scheduler.current->open_group.empty() || !g_scheduler.current->committed.empty()) {
    Fail("returned from the kernel with wgmma results never waited for (WgmmaCommit, WgmmaWait)");
  }
  CheckNobodyWaitsFor(threadIdx.x);
  g_scheduler.current->done = true;
  SwitchToScheduler(/*dying=*/true);
  Fail("a finished fiber was resumed");
}

// Prepares `f` so that switching to it enters FiberMain on a fresh stack.
void ResetFiber(Fiber& f, unsigned thread) {
  f.thread = thread;
  f.open_group.clear();
  f.committed.clear();
  f.done = false;
  f.waiting_at = nullptr;
  f.asan_fake_stack = nullptr;
#if EMU_ASAN
  // A finished fiber never unwinds its frames, so their redzones are still poisoned.
  ASAN_UNPOISON_MEMORY_REGION(f.stack.get(), kFiberStackBytes);
#endif
  auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kFiberStackBytes) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<uint64_t*>(top) - 9;  // control words, 6 registers, return address, pad
  slots[0] = 0x1F80u | (uint64_t{0x037Fu} << 32);     // default MXCSR, x87 control word
  for (int i = 1; i <= 6; ++i) slots[i] = 0;
  slots[7] = reinterpret_cast<uint64_t>(&FiberMain);  // EmuSwitch's `ret` lands here, rsp = 8 mod 16
  slots[8] = 0;
  f.sp = slots;
}

// Prints which threads wait at what (consecutive threads waiting at the same thing as one range).
[[noreturn]] void FailDeadlock() {
  std::fprintf(stderr, "cuda emulation: deadlock: every live thread waits at a barrier or warp collective that not "
                       "all of its threads reach:\n");
  const auto& fibers = g_scheduler.fibers;
  for (size_t i = 0; i < fibers.size();) {
    size_t j = i + 1;
    while (j < fibers.size() && fibers[j].done == fibers[i].done && fibers[j].waiting_at == fibers[i].waiting_at) ++j;
    std::fprintf(stderr, "  threads %zu..%zu: %s\n", i, j - 1,
                 fibers[i].done ? "returned" : (fibers[i].waiting_at ? fibers[i].waiting_at : "?"));
    i = j;
  }
  Fail("deadlock");
}

}  // namespace

// ------------------------------------------------------------------ device functions

void __syncthreads() {
  CheckCopiesTracked("__syncthreads");
  if (g_barrier.exited > 0) {
    Fail("__syncthreads after %u thread(s) of the block returned from the kernel", g_barrier.exited);
  }
  const uint64_t generation = g_barrier.generation;
  if (++g_barrier.arrived == blockDim.x) {
    g_barrier.arrived = 0;
    ++g_barrier.generation;
  } else {
    WaitUntil("__syncthreads", [&] { return g_barrier.generation != generation; });
  }
  ++g_scheduler.progress;
}

void __syncwarp(unsigned mask) {
  CheckCopiesTracked("__syncwarp");
  Meet(mask, Collective::kSyncWarp, LaneInput{});
}

float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width) {
  return Shuffle(mask, value, Lane() ^ static_cast<unsigned>(lane_mask), width);
}
int __shfl_xor_sync(unsigned mask, int value, int lane_mask, int width) {
  return Shuffle(mask, value, Lane() ^ static_cast<unsigned>(lane_mask), width);
}
unsigned __shfl_xor_sync(unsigned mask, unsigned value, int lane_mask, int width) {
  return Shuffle(mask, value, Lane() ^ static_cast<unsigned>(lane_mask), width);
}
float __shfl_sync(unsigned mask, float value, int src_lane, int width) {
  return Shuffle(mask, value, static_cast<unsigned>(src_lane), width);
}
int __shfl_sync(unsigned mask, int value, int src_lane, int width) {
  return Shuffle(mask, value, static_cast<unsigned>(src_lane), width);
}
unsigned __shfl_sync(unsigned mask, unsigned value, int src_lane, int width) {
  return Shuffle(mask, value, static_cast<unsigned>(src_lane), width);
}

unsigned __ballot_sync(unsigned mask, int predicate) {
  LaneInput input;
  input.bits = predicate != 0;
  const Meeting& m = Meet(mask, Collective::kVote, input);
  unsigned ballot = 0;
  for (unsigned lane = 0; lane < 32; ++lane) {
    if ((mask >> lane) & 1u) ballot |= m.lanes[lane].bits << lane;
  }
  return ballot;
}
int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

namespace s2attn {
namespace gpu {

namespace {
void EmulatedCopyAsync(const char* name, void* shared_dst, const void* global_src, size_t bytes) {
  CheckShared((std::string(name) + " destination").c_str(), shared_dst, bytes);
  if (reinterpret_cast<uintptr_t>(global_src) % bytes != 0) {
    Fail("%s: source %p is not %zu-byte aligned", name, global_src, bytes);
  }
  if (InSharedBuffer(global_src)) Fail("%s: source %p is shared memory, not global", name, global_src);
  std::memcpy(shared_dst, global_src, bytes);
  g_scheduler.current->untracked_copies = true;
}
}  // namespace

void CopyAsync16(void* shared_dst, const void* global_src) {
  EmulatedCopyAsync("CopyAsync16", shared_dst, global_src, 16);
}

void CopyAsync4(void* shared_dst, const void* global_src) {
  EmulatedCopyAsync("CopyAsync4", shared_dst, global_src, 4);
}

// mbarrier: the 8 bytes of the barrier hold the arrivals a phase needs (tagged, so that a barrier
// never initialised is caught: shared memory starts as NaN here) and, in `state`, the arrivals so
// far (low 31 bits) and the parity of the current phase (top bit).
namespace {
struct EmulatedMbarrier {
  uint32_t tagged_expected;
  uint32_t state;
};
static_assert(sizeof(EmulatedMbarrier) == sizeof(uint64_t), "an mbarrier is 8 bytes");
constexpr uint32_t kInitTag = 0xa5000000u, kCountMask = 0x00ffffffu;
constexpr uint32_t kPhaseBit = 0x80000000u;

EmulatedMbarrier* MbarrierAt(const char* what, uint64_t* barrier) {
  CheckShared(what, barrier, sizeof(EmulatedMbarrier));
  return reinterpret_cast<EmulatedMbarrier*>(barrier);
}

// Which threads of the block arrived in the current phase of each barrier, per thread its own
// arrival and its copies' (a second one of a kind in one phase would complete it early on the device).
std::map<const void*, std::vector<bool>> g_mbarrier_arrivals;
// Bytes of tensor-map copies a barrier's current phase still waits for (announced by
// MbarrierArriveExpectBytes, landed by LoadBox3d; may go below zero in between, as on the device).
std::map<const void*, int64_t> g_mbarrier_pending_bytes;

EmulatedMbarrier* InitialisedMbarrier(const char* what, uint64_t* barrier) {
  EmulatedMbarrier* m = MbarrierAt(what, barrier);
  if ((m->tagged_expected & ~kCountMask) != kInitTag) Fail("%s: barrier %p was not initialised", what, barrier);
  return m;
}
}  // namespace

void MbarrierInit(uint64_t* barrier, uint32_t count) {
  if (count == 0 || count > kCountMask) Fail("MbarrierInit: count %u out of range", count);
  *MbarrierAt("MbarrierInit", barrier) = EmulatedMbarrier{kInitTag | count, 0};
  g_mbarrier_arrivals[barrier].assign(2 * blockDim.x, false);
  g_mbarrier_pending_bytes[barrier] = 0;
}

namespace {
// A phase completes once every arrival it counts came and every byte announced to it landed.
void CompleteIfDone(uint64_t* barrier, EmulatedMbarrier* m) {
  if ((m->state & ~kPhaseBit) != (m->tagged_expected & kCountMask) || g_mbarrier_pending_bytes[barrier] != 0) return;
  m->state = (m->state & kPhaseBit) ^ kPhaseBit;
  g_mbarrier_arrivals[barrier].assign(2 * blockDim.x, false);
}

// One arrival of the current thread, of kind `kind` (0: its own, 1: its landed copies'): each
// thread may arrive once of each kind per phase.
void Arrive(const char* what, uint64_t* barrier, int kind) {
  EmulatedMbarrier* m = InitialisedMbarrier(what, barrier);
  std::vector<bool>& arrivals = g_mbarrier_arrivals[barrier];
  if (arrivals.size() != 2 * blockDim.x) arrivals.assign(2 * blockDim.x, false);
  std::vector<bool>::reference arrived_before = arrivals[2 * threadIdx.x + kind];
  if (arrived_before) Fail("%s: thread arrives twice in one phase of barrier %p", what, barrier);
  arrived_before = true;
  const uint32_t arrived = (m->state & ~kPhaseBit) + 1;
  if (arrived > (m->tagged_expected & kCountMask)) Fail("%s: more arrivals than barrier %p counts", what, barrier);
  m->state = (m->state & kPhaseBit) | arrived;
  CompleteIfDone(barrier, m);
  ++g_scheduler.progress;
}
}  // namespace

void MbarrierArrive(uint64_t* barrier) {
  CheckCopiesTracked("MbarrierArrive");
  Arrive("MbarrierArrive", barrier, 0);
}

// Copies land at the call here, so their arrival is immediate.
void CopyAsyncArriveOn(uint64_t* barrier) {
  Arrive("CopyAsyncArriveOn", barrier, 1);
  g_scheduler.current->untracked_copies = false;
}

void MbarrierWait(uint64_t* barrier, uint32_t parity) {
  const EmulatedMbarrier* m = InitialisedMbarrier("MbarrierWait", barrier);
  WaitUntil("MbarrierWait", [&] { return (m->state >> 31) != (parity & 1u); });
  ++g_scheduler.progress;
}

namespace sm90 {

void MbarrierArriveExpectBytes(uint64_t* barrier, uint32_t bytes) {
  CheckCopiesTracked("MbarrierArriveExpectBytes");
  InitialisedMbarrier("MbarrierArriveExpectBytes", barrier);
  g_mbarrier_pending_bytes[barrier] += bytes;
  Arrive("MbarrierArriveExpectBytes", barrier, 0);
}

uint64_t SwizzledTileDescriptor(const void* tile) {
  return SwizzledDescriptorAt(SharedOffset("SwizzledTileDescriptor", tile, 1024, 128));
}

uint64_t SwizzledTileDescriptor(const void* tile, const void* next_block) {
  return SwizzledDescriptorAt(SharedOffset("SwizzledTileDescriptor", tile, 1024, 128),
                              SharedOffset("SwizzledTileDescriptor", next_block, 1024, 128));
}

uint64_t Swizzled64TileDescriptor(const void* tile) {
  return SwizzledDescriptorAt(SharedOffset("Swizzled64TileDescriptor", tile, 1024, 64), 0, 64);
}

namespace {
void EmulatedWgmma(Collective kind, float* d, unsigned n, const uint32_t* a, uint64_t a_desc, uint64_t b_desc,
                   bool trans_b, uint32_t accumulate) {
  LaneInput input{};
  if (a != nullptr) std::memcpy(input.wgmma.a, a, sizeof input.wgmma.a);
  input.wgmma.issue = {a_desc, b_desc, n, trans_b, accumulate != 0};
  const Meeting& m = MeetWholeWarp(kind, input);
  // Asynchronous, as on the device: the result lands in d at the WgmmaWait that completes its group,
  // and d reads NaN until then. An accumulating wgmma adds to the newest result still on its way to
  // the same registers (a chain of k-steps), or to d as it is.
  Fiber& fiber = *g_scheduler.current;
  const auto newest_in = [d](const std::vector<PendingWgmma>& group) -> const float* {
    for (auto pending = group.rbegin(); pending != group.rend(); ++pending) {
      if (pending->d == d) return pending->values;
    }
    return nullptr;
  };
  const float* base = newest_in(fiber.open_group);
  for (auto group = fiber.committed.rbegin(); base == nullptr && group != fiber.committed.rend(); ++group) {
    base = newest_in(*group);
  }
  if (base == nullptr) base = d;
  PendingWgmma result{d, n / 2, {}};
  const unsigned g = Lane() / 4, t = Lane() % 4;
  for (unsigned i = 0; i < n / 2; ++i) {  // d[i] = (row g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1))
    const double product = m.rows[g + 8 * ((i >> 1) & 1)][8 * (i >> 2) + 2 * t + (i & 1)];
    result.values[i] = static_cast<float>((accumulate ? static_cast<double>(base[i]) : 0.0) + product);
  }
  fiber.open_group.push_back(result);
  for (unsigned i = 0; i < n / 2; ++i) d[i] = std::numeric_limits<float>::quiet_NaN();
}
}  // namespace

void WgmmaCommit() {
  Fiber& fiber = *g_scheduler.current;
  fiber.committed.push_back(std::move(fiber.open_group));
  fiber.open_group.clear();
}

void WgmmaWaitFor(int pending) {
  Fiber& fiber = *g_scheduler.current;
  while (fiber.committed.size() > static_cast<size_t>(pending)) {
    for (const PendingWgmma& result : fiber.committed.front()) {
      std::memcpy(result.d, result.values, result.count * sizeof(float));
    }
    fiber.committed.erase(fiber.committed.begin());
  }
}

// The collective of a wgmma on operands of type T.
template <typename T>
Collective KindOf() {
  return std::is_same_v<T, __half> ? Collective::kWgmmaF16 : Collective::kWgmma;
}
template <typename T, int kTransB>
void WgmmaM64N32K16(float (&d)[16], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 32, a, 0, b, kTransB, accumulate);
}
template <typename T>
void WgmmaM64N32K16SharedA(float (&d)[16], uint64_t a, uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 32, nullptr, a, b, false, accumulate);
}
template <typename T, int kTransB>
void WgmmaM64N64K16(float (&d)[32], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 64, a, 0, b, kTransB, accumulate);
}
template <typename T>
void WgmmaM64N64K16SharedA(float (&d)[32], uint64_t a, uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 64, nullptr, a, b, false, accumulate);
}
template <typename T>
void WgmmaM64N72K16(float (&d)[36], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 72, a, 0, b, true, accumulate);
}
template <typename T, int kTransB>
void WgmmaM64N128K16(float (&d)[64], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 128, a, 0, b, kTransB, accumulate);
}
template <typename T, int kTransB>
void WgmmaM64N8K16(float (&d)[4], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  EmulatedWgmma(KindOf<T>(), d, 8, a, 0, b, kTransB, accumulate);
}
// The forms the kernels of cuda/gpu use (sched_attn_device.cuh: m64n32 and m64n64 with A in shared memory, m64n64
// m64n32, m64n72, m64n128 and m64n8 with A in registers), in bfloat16 and float16, and the register-A m64n32 form
// with K-major B the self-test checks too.
template void WgmmaM64N72K16<__nv_bfloat16>(float (&)[36], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N72K16<__half>(float (&)[36], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N128K16<__nv_bfloat16, 1>(float (&)[64], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N128K16<__half, 1>(float (&)[64], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N8K16<__nv_bfloat16, 1>(float (&)[4], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N8K16<__half, 1>(float (&)[4], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N32K16SharedA<__half>(float (&)[16], uint64_t, uint64_t, uint32_t);
template void WgmmaM64N64K16<__half, 1>(float (&)[32], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N64K16SharedA<__half>(float (&)[32], uint64_t, uint64_t, uint32_t);
template void WgmmaM64N32K16<__nv_bfloat16, 0>(float (&)[16], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N32K16<__nv_bfloat16, 1>(float (&)[16], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N32K16<__half, 1>(float (&)[16], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N32K16SharedA<__nv_bfloat16>(float (&)[16], uint64_t, uint64_t, uint32_t);
template void WgmmaM64N64K16<__nv_bfloat16, 1>(float (&)[32], const uint32_t (&)[4], uint64_t, uint32_t);
template void WgmmaM64N64K16SharedA<__nv_bfloat16>(float (&)[32], uint64_t, uint64_t, uint32_t);

}  // namespace sm90

// ------------------------------------------------------------------ tensor maps
//
// The emulation's cuTensorMapEncodeTiled writes its own description into the map's opaque bytes
// (tagged, so that a map from elsewhere is refused): only what the kernels use is emulated (element
// strides 1, no interleave, no swizzle, the 128-byte one over 128-byte box rows or the 64-byte one over 64-byte
// rows, zeros out of bounds).
namespace {
struct EmulatedTensorMap {
  uint64_t tag;
  const char* base;
  uint32_t rank, element_bytes, swizzle_bytes;  // swizzle_bytes 0: none
  uint32_t dims[5];
  uint64_t strides[5];  // bytes; strides[0] is the element size
  uint16_t box[5];
};
static_assert(sizeof(EmulatedTensorMap) <= sizeof(CUtensorMap), "the description fits the opaque map");
constexpr uint64_t kTensorMapTag = 0x5332544d4150ull;  // "S2TMAP"

CUresult CUDAAPI EncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* base,
                             const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                             const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                             CUtensorMapSwizzle swizzle, CUtensorMapL2promotion /*promotion*/,
                             CUtensorMapFloatOOBfill fill) {
  EmulatedTensorMap e{};
  e.tag = kTensorMapTag;
  e.base = static_cast<const char*>(base);
  e.rank = rank;
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16: e.element_bytes = 2; break;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: e.element_bytes = 4; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  if (rank < 1 || rank > 5 || reinterpret_cast<uintptr_t>(base) % 16 != 0 ||
      interleave != CU_TENSOR_MAP_INTERLEAVE_NONE || fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE ||
      (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_128B &&
       swizzle != CU_TENSOR_MAP_SWIZZLE_64B)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  e.swizzle_bytes = swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : 0;
  e.strides[0] = e.element_bytes;
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > UINT32_MAX || box[i] == 0 || box[i] > 256 || element_strides[i] != 1) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    e.dims[i] = static_cast<uint32_t>(dims[i]);
    e.box[i] = static_cast<uint16_t>(box[i]);
    if (i > 0) {
      if (strides[i - 1] % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
      e.strides[i] = strides[i - 1];
    }
  }
  if ((e.swizzle_bytes != 0 && box[0] * e.element_bytes != e.swizzle_bytes) || box[0] * e.element_bytes % 16 != 0) {
    return CUDA_ERROR_INVALID_VALUE;  // swizzled rows other than the swizzle's width: not emulated
  }
  std::memset(map, 0, sizeof *map);
  std::memcpy(map, &e, sizeof e);
  return CUDA_SUCCESS;
}
}  // namespace

namespace sm90 {

namespace {
// A box of a map of any rank at `start` (element coordinates, innermost first) into shared memory: the box's
// rows (its innermost extent) one after another, outer coordinates in order, zeros outside the tensor.
void LoadBox(const char* what, void* destination, const CUtensorMap* map, uint32_t rank, const int* start,
             uint64_t* barrier) {
  EmulatedTensorMap e;
  std::memcpy(&e, map, sizeof e);
  if (e.tag != kTensorMapTag) Fail("%s: %p is not a tensor map of the emulation's cuTensorMapEncodeTiled", what, map);
  if (e.rank != rank) Fail("%s: the map has rank %u", what, e.rank);
  const uint32_t row_bytes = e.box[0] * e.element_bytes;
  uint32_t rows = 1;
  for (uint32_t d = 1; d < rank; ++d) rows *= e.box[d];
  const uint32_t first = SharedOffset(what, destination, e.swizzle_bytes != 0 ? 8 * e.swizzle_bytes : 128,
                                      row_bytes * rows);
  char* shared = reinterpret_cast<char*>(s2attn_dynamic_shared);
  for (uint32_t row = 0; row < rows; ++row) {
    bool inside = true;
    int64_t offset = 0;
    for (uint32_t d = 1, rest = row; d < rank; rest /= e.box[d], ++d) {
      const int64_t coordinate = start[d] + int64_t(rest % e.box[d]);
      inside = inside && coordinate >= 0 && coordinate < e.dims[d];
      offset += coordinate * int64_t(e.strides[d]);
    }
    for (uint32_t i = 0; i < e.box[0]; ++i) {
      const int64_t column = start[0] + int64_t(i);
      uint32_t address = first + row * row_bytes + i * e.element_bytes;
      if (e.swizzle_bytes != 0) address ^= ((address >> 7) & (e.swizzle_bytes / 16 - 1)) << 4;
      if (inside && column >= 0 && column < e.dims[0]) {
        std::memcpy(shared + address, e.base + column * e.strides[0] + offset, e.element_bytes);
      } else {
        std::memset(shared + address, 0, e.element_bytes);
      }
    }
  }
  EmulatedMbarrier* m = InitialisedMbarrier(what, barrier);
  g_mbarrier_pending_bytes[barrier] -= int64_t{row_bytes} * rows;
  CompleteIfDone(barrier, m);
  ++g_scheduler.progress;
}
}  // namespace

void LoadBox3d(void* destination, const CUtensorMap* map, int x, int y, int z, uint64_t* barrier) {
  const int start[3] = {x, y, z};
  LoadBox("LoadBox3d", destination, map, 3, start, barrier);
}

void LoadBox5d(void* destination, const CUtensorMap* map, int x, int y, int z, int w, int v, uint64_t* barrier) {
  const int start[5] = {x, y, z, w, v};
  LoadBox("LoadBox5d", destination, map, 5, start, barrier);
}

}  // namespace sm90

}  // namespace gpu
}  // namespace s2attn

// ------------------------------------------------------------------ runtime API

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int /*version*/,
                                                       unsigned long long /*flags*/,
                                                       enum cudaDriverEntryPointQueryResult* status) {
  const bool known = std::string(symbol) == "cuTensorMapEncodeTiled";
  *function = known ? reinterpret_cast<void*>(&s2attn::gpu::EncodeTiled) : nullptr;
  if (status != nullptr) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const cudaError_t error = g_last_error;
  g_last_error = cudaSuccess;
  return error;
}

cudaError_t CUDARTAPI cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  switch (attr) {
    case cudaFuncAttributeMaxDynamicSharedMemorySize:
      if (value < 0 || static_cast<size_t>(value) > s2attn::gpu::kSharedCapacity) {
        return g_last_error = cudaErrorInvalidValue;
      }
      g_shared_limits[func] = static_cast<size_t>(value);
      return cudaSuccess;
    case cudaFuncAttributePreferredSharedMemoryCarveout:  // a hint: nothing to emulate
      return value >= -1 && value <= 100 ? cudaSuccess : (g_last_error = cudaErrorInvalidValue);
    default:
      std::fprintf(stderr, "cuda emulation: cudaFuncSetAttribute: attribute %d is not emulated\n",
                   static_cast<int>(attr));
      return g_last_error = cudaErrorInvalidValue;
  }
}

cudaError_t CUDARTAPI cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                                       cudaStream_t /*stream*/) {
  // The attention kernels of cuda/gpu take one NbhdAttnGpuParams by value and launch through here; other
  // kernels (delta, experimental/cuda) launch through the typed overload of emulation.h.
  const auto kernel = reinterpret_cast<void (*)(s2attn::NbhdAttnGpuParams)>(const_cast<void*>(func));
  const s2attn::NbhdAttnGpuParams params = *static_cast<const s2attn::NbhdAttnGpuParams*>(args[0]);
  return EmulatedLaunch(func, grid, block, shared_bytes, [kernel, params] { kernel(params); });
}

cudaError_t EmulatedLaunch(const void* func, dim3 grid, dim3 block, size_t shared_bytes,
                           std::function<void()> kernel) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      block.x == 0 || block.x > 1024 || block.x % 32 != 0 || block.y != 1 || block.z != 1) {
    return g_last_error = cudaErrorInvalidConfiguration;
  }
  const auto limit = g_shared_limits.find(func);
  if (shared_bytes > (limit == g_shared_limits.end() ? kDefaultSharedLimit : limit->second)) {
    return g_last_error = cudaErrorInvalidValue;
  }
  g_scheduler.kernel = std::move(kernel);
  g_scheduler.shared_bytes = shared_bytes;
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
    // Gates start over (not reallocated: a Warp is a few KiB and blocks are many).
    g_warps.resize(block.x / 32);
    for (Warp& warp : g_warps) {
      warp.full.arrived = 0;
      warp.full.generation = 0;
      warp.partial.clear();
      warp.exited = 0;
    }
    g_barrier = BlockBarrier{};
    g_wgmma_issues.assign(block.x / 32, {});
    s2attn::gpu::g_mbarrier_pending_bytes.clear();
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
      if (live > 0 && g_scheduler.progress == progress_before) FailDeadlock();
    }
    CheckWgmmaIssuesComplete();
    for (const auto& [barrier, pending] : s2attn::gpu::g_mbarrier_pending_bytes) {
      if (pending != 0) {
        Fail("barrier %p ends the block with %lld bytes announced but not landed (or landed but not announced)",
             barrier, static_cast<long long>(pending));
      }
    }
  }
#if EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(shared, s2attn::gpu::kSharedCapacity);
#endif
  return cudaSuccess;
}

// ------------------------------------------------------------------ runtime API of standalone programs
//
// What the programs of experimental/cuda use beyond the kernels' launchers: device memory is host memory,
// copies are memcpy, events read the host clock (timings mean nothing here), one device.

struct CUevent_st {
  std::chrono::steady_clock::time_point at;
};

cudaError_t CUDARTAPI cudaMalloc(void** pointer, size_t bytes) {
  *pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *pointer != nullptr || bytes == 0 ? cudaSuccess : (g_last_error = cudaErrorMemoryAllocation);
}
cudaError_t CUDARTAPI cudaFree(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMemcpy(void* destination, const void* source, size_t bytes, enum cudaMemcpyKind) {
  std::memcpy(destination, source, bytes);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMemset(void* destination, int value, size_t bytes) {
  std::memset(destination, value, bytes);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st{};
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  event->at = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}
const char* CUDARTAPI cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "emulated error";
}
cudaError_t CUDARTAPI cudaGetDeviceProperties(struct cudaDeviceProp* prop, int /*device*/) {
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "host emulation");
  prop->multiProcessorCount = 1;
  prop->sharedMemPerBlockOptin = s2attn::gpu::kSharedCapacity;
  return cudaSuccess;
}
