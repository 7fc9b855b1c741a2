// Host side of the tiled kernels: which instantiation runs a call, and its launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/kernel_limits.h"
#include "gpu/device_common.cuh"
#include "gpu/sixteen_bit_dispatch.cuh"
#include "gpu/tiled_attn_device.cuh"
#include "gpu/tiled_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace tiled {
inline namespace S2ATTN_TILED_SHAPE {

static_assert(sizeof(kTiledHeadDims) == 3 * sizeof(int) && kTiledHeadDims[0] == 32 && kTiledHeadDims[1] == 64 &&
                  kTiledHeadDims[2] == 128,
              "DispatchSixteenBit instantiates exactly the head dims of common/kernel_limits.h");

// Calls launch(SixteenBitVariant<T, D>{}) for 16-bit T and Dk == Dv == D in kTiledHeadDims; anything
// else is cudaErrorInvalidValue (the handlers check TiledAttnSupported first).
template <typename Launch>
cudaError_t DispatchTiled(const NbhdAttnGpuParams& p, Launch&& launch) {
  if (!TiledAttnSupported(p)) return cudaErrorInvalidValue;
  return DispatchSixteenBit(p, launch);
}

// One block per unit of kTilePoints longitudes of every local row of the walking grid.
template <int D>
cudaError_t LaunchUnits(void (*kernel)(NbhdAttnGpuParams), cudaStream_t stream, const NbhdAttnGpuParams& p,
                        int32_t rows, int32_t cols) {
  constexpr size_t kShared = BlockSharedBytes<D>();
  const cudaError_t status =
      cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kShared));
  if (status != cudaSuccess) return status;
  const int64_t tiles = (int64_t{cols} + kTilePoints - 1) / kTilePoints;
  return LaunchRowGrid(kernel, stream, p, rows, tiles, kThreads, kShared);
}

// LaunchUnits over the first ranks of the walking grid's row order, then `stencil(stream)` for the rows of
// the stencil pairs (its last 2 * p.num_stencil_pairs ranks): the tiled launchers. One after the other: the
// tiled blocks take the whole register file, so a stencil block on a second stream could only fill the
// tiled kernel's tail, and is no faster (measured: docs/performance.md).
template <int D, typename Stencil>
cudaError_t LaunchUnitsAndStencilRows(void (*kernel)(NbhdAttnGpuParams), cudaStream_t stream,
                                      const NbhdAttnGpuParams& p, bool walk_keys, Stencil&& stencil) {
  const int32_t rows = walk_keys ? p.nk_lat : p.nq_lat, cols = walk_keys ? p.nk_lon : p.nq_lon;
  const int64_t tiled_rows = int64_t{rows} - 2 * int64_t{p.num_stencil_pairs};
  if (p.num_stencil_pairs < 0 || tiled_rows < 0 || (p.num_stencil_pairs > 0 && p.stencil_pairs == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t status = LaunchUnits<D>(kernel, stream, p, static_cast<int32_t>(tiled_rows), cols);
  return status != cudaSuccess || p.num_stencil_pairs == 0 ? status : stencil(stream);
}

}  // inline namespace (the pipeline shape)
}  // namespace tiled
}  // namespace gpu
}  // namespace s2attn
