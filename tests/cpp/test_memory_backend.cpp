#include "kvcache/memory_backend.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

TEST(MemoryBackendTest, HostAllocatesZeroedMemoryAndCopies2D) {
  auto backend = MakeHostBackend();
  EXPECT_EQ(backend->Kind(), BackendKind::kHost);
  auto* src = static_cast<std::uint8_t*>(backend->Allocate(CacheLevel::kPrimary, 64));
  auto* dst = static_cast<std::uint8_t*>(backend->Allocate(CacheLevel::kSecondary, 64));
  ASSERT_NE(src, nullptr);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(src[i], 0);
    src[i] = static_cast<std::uint8_t>(i);
  }
  // 4 rows of 3 bytes, source pitch 16, destination pitch 8.
  backend->Copy2D(dst, CacheLevel::kSecondary, 8, src, CacheLevel::kPrimary, 16, 3, 4);
  backend->Synchronize();
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 8; ++c) EXPECT_EQ(dst[r * 8 + c], c < 3 ? r * 16 + c : 0) << r << "," << c;
  }
  backend->Free(CacheLevel::kPrimary, src);
  backend->Free(CacheLevel::kSecondary, dst);
}

TEST(MemoryBackendTest, VirtualHasNoMemory) {
  auto backend = MakeBackend(BackendKind::kVirtual);
  EXPECT_EQ(backend->Kind(), BackendKind::kVirtual);
  EXPECT_FALSE(backend->HasMemory());
  EXPECT_EQ(backend->Allocate(CacheLevel::kPrimary, 1 << 20), nullptr);
}

TEST(MemoryBackendTest, AutoFallsBackToHostWithoutDevice) {
  auto backend = MakeBackend(BackendKind::kAuto);
  EXPECT_EQ(backend->Kind(), CudaAvailable() ? BackendKind::kCuda : BackendKind::kHost);
}

TEST(MemoryBackendTest, CudaWithoutDeviceIsACudaError) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_THROW(MakeBackend(BackendKind::kCuda), CudaError);
  EXPECT_THROW(CudaMemGetInfo(), CudaError);
}

TEST(MemoryBackendTest, CudaAllocatesAndCopies) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  auto backend = MakeBackend(BackendKind::kCuda);
  auto* host = static_cast<std::uint8_t*>(backend->Allocate(CacheLevel::kSecondary, 256));
  void* dev = backend->Allocate(CacheLevel::kPrimary, 256);
  for (int i = 0; i < 256; ++i) host[i] = static_cast<std::uint8_t>(i);
  backend->Copy2D(dev, CacheLevel::kPrimary, 256, host, CacheLevel::kSecondary, 256, 256, 1);
  auto* back = static_cast<std::uint8_t*>(backend->Allocate(CacheLevel::kSecondary, 256));
  backend->Copy2D(back, CacheLevel::kSecondary, 16, dev, CacheLevel::kPrimary, 32, 16, 8);
  backend->Synchronize();
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 16; ++c) EXPECT_EQ(back[r * 16 + c], (r * 32 + c) & 0xff);
  }
  backend->Free(CacheLevel::kPrimary, dev);
  backend->Free(CacheLevel::kSecondary, host);
  backend->Free(CacheLevel::kSecondary, back);
}

TEST(TypesTest, ParseNames) {
  EXPECT_EQ(ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(DTypeBytes(DType::kFloat32), 4);
  EXPECT_EQ(DTypeBytes(DType::kFp8), 1);
  EXPECT_THROW(ParseDType("float64"), std::invalid_argument);
  EXPECT_EQ(ParseBackendKind("virtual"), BackendKind::kVirtual);
  EXPECT_THROW(ParseBackendKind("gpu"), std::invalid_argument);
}

}  // namespace
}  // namespace kvcache
