#include "kvcache/memory_backend.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

class HostBackend final : public MemoryBackend {
 public:
  BackendKind Kind() const override { return BackendKind::kHost; }
  void* Allocate(CacheLevel /*level*/, std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    // calloc: zero-filled, and large requests are mapped lazily by the C library.
    void* ptr = std::calloc(bytes, 1);
    if (ptr == nullptr) {
      throw KVCacheError(detail::Concat("host allocation of ", bytes, " bytes failed"));
    }
    return ptr;
  }
  void Free(CacheLevel /*level*/, void* ptr) noexcept override { std::free(ptr); }
  void Copy2D(void* dst, CacheLevel /*dst_level*/, std::size_t dst_pitch, const void* src,
              CacheLevel /*src_level*/, std::size_t src_pitch, std::size_t width,
              std::size_t rows) override {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    if (width == dst_pitch && width == src_pitch) {
      std::memmove(d, s, width * rows);
      return;
    }
    for (std::size_t r = 0; r < rows; ++r) std::memmove(d + r * dst_pitch, s + r * src_pitch, width);
  }
  void Synchronize() override {}
};

class VirtualBackend final : public MemoryBackend {
 public:
  BackendKind Kind() const override { return BackendKind::kVirtual; }
  bool HasMemory() const override { return false; }
  void* Allocate(CacheLevel /*level*/, std::size_t /*bytes*/) override { return nullptr; }
  void Free(CacheLevel /*level*/, void* /*ptr*/) noexcept override {}
  void Copy2D(void*, CacheLevel, std::size_t, const void*, CacheLevel, std::size_t, std::size_t,
              std::size_t) override {}
  void Synchronize() override {}
};

}  // namespace

std::unique_ptr<MemoryBackend> MakeHostBackend() { return std::make_unique<HostBackend>(); }
std::unique_ptr<MemoryBackend> MakeVirtualBackend() { return std::make_unique<VirtualBackend>(); }

bool CudaCompiled() {
#ifdef KVCACHE_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool CudaAvailable() {
#ifdef KVCACHE_HAVE_CUDA
  return detail::CudaDeviceUsable();
#else
  return false;
#endif
}

std::pair<std::size_t, std::size_t> CudaMemGetInfo() {
#ifdef KVCACHE_HAVE_CUDA
  return detail::CudaMemInfo();
#else
  throw CudaError(0, "kvcache was built without the CUDA backend");
#endif
}

std::unique_ptr<MemoryBackend> MakeBackend(BackendKind kind) {
  switch (kind) {
    case BackendKind::kHost:
      return MakeHostBackend();
    case BackendKind::kVirtual:
      return MakeVirtualBackend();
    case BackendKind::kCuda:
#ifdef KVCACHE_HAVE_CUDA
      return detail::MakeCudaBackend();
#else
      throw CudaError(0, "backend 'cuda' requested but kvcache was built without CUDA");
#endif
    case BackendKind::kAuto:
      if (CudaAvailable()) {
#ifdef KVCACHE_HAVE_CUDA
        return detail::MakeCudaBackend();
#endif
      }
      return MakeHostBackend();
  }
  ThrowInvalid("bad backend kind");
}

}  // namespace kvcache
