// Ring walking: which points of the visited ring grid a walking point meets, shared by every
// handler of the ring targets. Plain C++ with no XLA or CUDA headers; __host__ __device__ under nvcc.
//
// Tables (jax_s2attn/ring_plan.py, RingPatterns, as int32):
//   walk_rings [nrings_walk, 4]   (first point, points, first pattern, period) of every walking ring;
//   pattern_offsets [npatterns + 1], pattern_arcs [narcs, 6]
//                                 (visited ring, its first point, start, length, nlon, shift) per arc.
// Point i of a walking ring has pattern `first pattern + i % period` and position `i / period`;
// it meets the visited points `first + (start + position * shift + t) mod nlon`, t < length:
// at most two runs of consecutive points (two where the arc passes the ring's first point).
//
// Typical walk:
//   const RingPoint at = RingPointOf(walk_rings + kWalkRingFields * ring, i);
//   for (int32_t a = offsets[at.pattern]; a < offsets[at.pattern + 1]; ++a) {
//     const int32_t* arc = arcs + kRingArcFields * a;
//     const RingRuns runs = RunsOfArc(arc, at.position);          // ClampedRunsOfArc on device tables
//     for (int32_t r = 0; r < runs.count; ++r) visit(arc[0], runs.first[r], runs.len[r]);
//   }
#pragma once

#include <cstdint>

#include "common/arc_walk.h"  // S2ATTN_HOST_DEVICE

namespace s2attn {

inline constexpr int kWalkRingFields = 4;
inline constexpr int kRingArcFields = 6;
// The most points of one ring (jax_s2attn.grids.MAX_RING_POINTS): start + position * shift < 2 * nlon and
// first + nlon stay inside int32.
inline constexpr int64_t kMaxRingPoints = (int64_t{1} << 31) / 4 - 1;

// Where walking point i of a ring reads its arcs.
struct RingPoint {
  int32_t pattern, position;
};

S2ATTN_HOST_DEVICE RingPoint RingPointOf(const int32_t* walk_ring, int32_t i) {
  const int32_t period = walk_ring[3];
  return RingPoint{walk_ring[2] + i % period, i / period};
}

// The visited points of one arc: runs of consecutive point indices, in the arc's order.
struct RingRuns {
  int32_t count;     // 1 or 2
  int32_t first[2];  // point index (ring order of the visited grid) of each run's first point
  int32_t len[2];    // run lengths, >= 1
};

// The runs of an arc of `length` points of a ring of `nlon` points from `first`, starting at index `start`
// (0 <= start < nlon, 0 <= length <= nlon); none for length 0.
S2ATTN_HOST_DEVICE RingRuns RunsFrom(int32_t first, int32_t start, int32_t length, int32_t nlon) {
  const int32_t head = length < nlon - start ? length : nlon - start;
  RingRuns runs{head > 0 ? 1 : 0, {first + start, first}, {head, length - head}};
  if (length > head) runs.count = 2;
  return runs;
}

// The runs of `arc` at `position`. Requires 0 <= start < nlon, 1 <= length <= nlon and
// 0 <= position * shift < nlon: the CPU handlers check every table entry before walking.
S2ATTN_HOST_DEVICE RingRuns RunsOfArc(const int32_t* arc, int32_t position) {
  const int32_t nlon = arc[4];
  int32_t start = arc[2] + position * arc[5];  // < 2 * nlon: one conditional subtract wraps it
  if (start >= nlon) start -= nlon;
  return RunsFrom(arc[1], start, arc[3], nlon);
}

S2ATTN_HOST_DEVICE int32_t ClampToRange(int32_t x, int32_t lo, int32_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The runs of an arc read from a table that was not checked (device memory): every field is clamped into a
// ring of at most `points` points inside [0, points), so any table visits only points of the grid. For a valid
// arc the runs are RunsOfArc's.
S2ATTN_HOST_DEVICE RingRuns ClampedRunsOfArc(int32_t first, int32_t start, int32_t length, int32_t nlon,
                                             int32_t shift, int32_t position, int32_t points) {
  if (points < 1) return RingRuns{0, {0, 0}, {0, 0}};
  nlon = ClampToRange(nlon, 1, points);
  first = ClampToRange(first, 0, points - nlon);
  length = ClampToRange(length, 0, nlon);
  const int64_t moved = int64_t{ClampToRange(start, 0, nlon - 1)} +
                        int64_t{ClampToRange(shift, 0, nlon)} * ClampToRange(position, 0, nlon);
  return RunsFrom(first, static_cast<int32_t>(moved % nlon), length, nlon);
}

}  // namespace s2attn
