// CUDA memory backend: primary pools from cudaMalloc, secondary pools from cudaMallocHost,
// copies with cudaMemcpy2DAsync on one dedicated stream (so copies complete in issue order).
// Compiled only when KVCACHE_HAVE_CUDA; linked against the static CUDA runtime.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "kvcache/errors.h"
#include "kvcache/memory_backend.h"

namespace kvcache {
namespace {

[[noreturn]] void ThrowCuda(cudaError_t err, const char* what) {
  std::string msg = detail::Concat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (",
                                   cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) throw DeviceOOMError(static_cast<int>(err), msg);
  throw CudaError(static_cast<int>(err), msg);
}

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) ThrowCuda(err, what);
}

class CudaBackend final : public MemoryBackend {
 public:
  CudaBackend() {
    Check(cudaGetDevice(&device_), "cudaGetDevice");
    Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaBackend() override {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }
  BackendKind Kind() const override { return BackendKind::kCuda; }

  void* Allocate(CacheLevel level, std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* ptr = nullptr;
    if (level == CacheLevel::kPrimary) {
      cudaError_t err = cudaMalloc(&ptr, bytes);
      if (err != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error state of the runtime
        if (err == cudaErrorMemoryAllocation) {
          throw DeviceOOMError(static_cast<int>(err),
                               detail::Concat("device out of memory allocating ", bytes,
                                              " bytes (cudaMalloc: cudaErrorMemoryAllocation)"));
        }
        ThrowCuda(err, "cudaMalloc");
      }
      Check(cudaMemsetAsync(ptr, 0, bytes, stream_), "cudaMemsetAsync");
      Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    } else {
      Check(cudaMallocHost(&ptr, bytes), "cudaMallocHost");
      std::memset(ptr, 0, bytes);
    }
    return ptr;
  }

  void Free(CacheLevel level, void* ptr) noexcept override {
    if (ptr == nullptr) return;
    cudaStreamSynchronize(stream_);
    if (level == CacheLevel::kPrimary) {
      cudaFree(ptr);
    } else {
      cudaFreeHost(ptr);
    }
  }

  void Copy2D(void* dst, CacheLevel /*dst_level*/, std::size_t dst_pitch, const void* src,
              CacheLevel /*src_level*/, std::size_t src_pitch, std::size_t width,
              std::size_t rows) override {
    // cudaMemcpyDefault: unified addressing tells device from pinned host memory.
    Check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault,
                            stream_),
          "cudaMemcpy2DAsync");
    pending_ = true;
  }

  void Synchronize() override {
    if (!pending_) return;
    Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    pending_ = false;
  }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool pending_ = false;  // copies issued since the last Synchronize
};

}  // namespace

namespace detail {

std::unique_ptr<MemoryBackend> MakeCudaBackend() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) ThrowCuda(err, "cudaGetDeviceCount");
  if (count == 0) throw CudaError(0, "backend 'cuda' requested but no CUDA device is present");
  return std::make_unique<CudaBackend>();
}

bool CudaDeviceUsable() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

std::pair<std::size_t, std::size_t> CudaMemInfo() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  Check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return {free_bytes, total_bytes};
}

}  // namespace detail
}  // namespace kvcache
