// Where KV bytes live: device memory (CUDA), ordinary host memory, or nowhere (virtual).
#pragma once

#include <cstddef>
#include <memory>
#include <utility>

#include "kvcache/types.h"

namespace kvcache {

/// Allocates pool memory and moves bytes between pools. Implementations own no pool state;
/// the caller frees what it allocated. Not thread-safe; the manager serializes access.
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;
  /// The concrete kind (never kAuto).
  virtual BackendKind Kind() const = 0;
  /// False for the virtual backend: pools have no memory and copies do nothing.
  virtual bool HasMemory() const { return true; }
  /// Allocates zero-filled memory for a primary (device) or secondary (host) pool.
  virtual void* Allocate(CacheLevel level, std::size_t bytes) = 0;
  /// Frees what Allocate(level, ...) returned; never throws.
  virtual void Free(CacheLevel level, void* ptr) noexcept = 0;
  /// Copies `rows` rows of `width` bytes from `src` (row pitch `src_pitch`) to `dst` (row pitch
  /// `dst_pitch`). May run asynchronously; copies complete in issue order, and Synchronize()
  /// waits for all of them.
  virtual void Copy2D(void* dst, CacheLevel dst_level, std::size_t dst_pitch, const void* src,
                      CacheLevel src_level, std::size_t src_pitch, std::size_t width,
                      std::size_t rows) = 0;
  /// Waits until every copy issued so far has completed (cheap when none is pending).
  virtual void Synchronize() = 0;
};

/// Host pools from calloc, copies with memcpy.
std::unique_ptr<MemoryBackend> MakeHostBackend();
/// Bookkeeping only: Allocate returns nullptr and copies do nothing.
std::unique_ptr<MemoryBackend> MakeVirtualBackend();
/// Creates the backend of `kind`; kAuto means CUDA when CudaAvailable(), else host.
/// Asking for kCuda without a usable device throws CudaError.
std::unique_ptr<MemoryBackend> MakeBackend(BackendKind kind);

/// True when the CUDA backend was compiled in.
bool CudaCompiled();
/// True when the CUDA backend was compiled in and a device is usable now.
bool CudaAvailable();
/// (free, total) bytes of the current device; throws CudaError without a usable device.
std::pair<std::size_t, std::size_t> CudaMemGetInfo();

namespace detail {
#ifdef KVCACHE_HAVE_CUDA
std::unique_ptr<MemoryBackend> MakeCudaBackend();
bool CudaDeviceUsable();
std::pair<std::size_t, std::size_t> CudaMemInfo();
#endif
}  // namespace detail

}  // namespace kvcache
