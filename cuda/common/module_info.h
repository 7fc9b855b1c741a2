// What every extension module exports (read by jax_s2attn/ops/_ffi.py): its build and its targets.
#pragma once

#include <string>
#include <type_traits>

#include "common/kernel_limits.h"
#include "common/nbhd_params.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/c_api.h"

namespace s2attn {

template <typename T, size_t N>
nanobind::tuple TupleOf(const T (&values)[N]) {
  nanobind::list items;
  for (const T& value : values) items.append(value);
  return nanobind::tuple(items);
}

// The limits of common/kernel_limits.h (a module adds those of its own kernels).
inline nanobind::dict KernelLimits() {
  nanobind::dict limits;
  limits["arc_dtypes"] = TupleOf(kArcDtypes);
  limits["stencil_max_other_rows"] = kStencilMaxOtherRows;
  limits["stencil_max_half"] = kStencilMaxHalf;
  limits["scheduled_shape"] = nanobind::make_tuple(kSchedTileRows, kSchedTileCols, kSchedChunkCols);
  limits["scheduled_runs"] = nanobind::make_tuple(kSchedTileRuns, kSchedRunPoints);
  limits["scheduled_head_dims"] = TupleOf(kSchedHeadDims);
  limits["scheduled_dtypes"] = TupleOf(kSchedDtypes);
  return limits;
}

// The build (the jaxlib whose FFI headers it was compiled against) and the kernels' limits.
inline nanobind::dict BuildInfo(nanobind::dict limits = KernelLimits()) {
  nanobind::dict info;
  info["jaxlib_version"] = std::string(JAXLIB_BUILD_VERSION);
  info["ffi_api_version"] = nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  info["limits"] = limits;
  return info;
}

template <typename Fn>
nanobind::capsule HandlerCapsule(Fn* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(handler));
}

// The registrations() dict of a module: target name -> handler capsule. Every module has the
// arc targets and delta (which every native backward runs).
template <typename Fwd, typename Dq, typename Dkv, typename Delta>
nanobind::dict NbhdRegistrations(Fwd* forward, Dq* backward_dq, Dkv* backward_dkv, Delta* delta) {
  nanobind::dict targets;
  targets[kTargetDelta] = HandlerCapsule(delta);
  targets[kTargetForward] = HandlerCapsule(forward);
  targets[kTargetBackwardDq] = HandlerCapsule(backward_dq);
  targets[kTargetBackwardDkv] = HandlerCapsule(backward_dkv);
  return targets;
}

// Adds the ring-grid targets (both modules) to a registrations() dict.
template <typename Fwd, typename Dq, typename Dkv>
void AddRingRegistrations(nanobind::dict& targets, Fwd* forward, Dq* backward_dq, Dkv* backward_dkv) {
  targets[kTargetRingForward] = HandlerCapsule(forward);
  targets[kTargetRingBackwardDq] = HandlerCapsule(backward_dq);
  targets[kTargetRingBackwardDkv] = HandlerCapsule(backward_dkv);
}

// Adds the stencil targets (CUDA only) to a registrations() dict.
template <typename Fwd, typename Dq, typename Dkv, typename DqDelta>
void AddStencilRegistrations(nanobind::dict& targets, Fwd* forward, Dq* backward_dq, Dkv* backward_dkv,
                             DqDelta* backward_dq_delta) {
  targets[kTargetStencilForward] = HandlerCapsule(forward);
  targets[kTargetStencilBackwardDq] = HandlerCapsule(backward_dq);
  targets[kTargetStencilBackwardDkv] = HandlerCapsule(backward_dkv);
  targets[kTargetStencilBackwardDqDelta] = HandlerCapsule(backward_dq_delta);
}

// Adds the scheduled targets (CUDA only) to a registrations() dict.
template <typename Fwd, typename Dq, typename Dkv, typename DqDelta>
void AddScheduledRegistrations(nanobind::dict& targets, Fwd* forward, Dq* backward_dq, Dkv* backward_dkv,
                               DqDelta* backward_dq_delta) {
  targets[kTargetScheduledForward] = HandlerCapsule(forward);
  targets[kTargetScheduledBackwardDq] = HandlerCapsule(backward_dq);
  targets[kTargetScheduledBackwardDkv] = HandlerCapsule(backward_dkv);
  targets[kTargetScheduledBackwardDqDelta] = HandlerCapsule(backward_dq_delta);
}

}  // namespace s2attn
