// Basic value types shared by every kvcache module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvcache {

using BlockId = std::int32_t;     ///< Block id, per window: primary slots first, then secondary.
using SeqId = std::int64_t;       ///< Request (sequence) id chosen by the engine.
using WindowSize = std::int32_t;  ///< Attention window in tokens; full attention = max_seq_len.
using TokenId = std::int32_t;     ///< Token id; must be >= 0.

/// Entry of a block list for a position that holds no block (released by a sliding window).
inline constexpr BlockId kNullBlock = -1;
/// Value written to the block-offset table where a position holds no block.
inline constexpr std::int32_t kOffsetSentinel = -1;

inline constexpr int kMinPriority = 0;
inline constexpr int kMaxPriority = 100;
inline constexpr int kDefaultPriority = 35;

/// Where a block's memory lives: device (primary) or host (secondary) pool.
enum class CacheLevel : std::uint8_t { kPrimary = 0, kSecondary = 1 };

/// Element type of the KV cache.
enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16, kFp8, kInt8 };

/// Bytes of one element of `dtype`.
int DTypeBytes(DType dtype);
/// Parses "float32", "float16", "bfloat16", "fp8" or "int8"; throws std::invalid_argument.
DType ParseDType(const std::string& name);
std::string DTypeName(DType dtype);

/// Memory backend selection; kAuto picks kCuda when a device is usable, else kHost.
enum class BackendKind : std::uint8_t { kAuto, kCuda, kHost, kVirtual };
/// Parses "auto", "cuda", "host" or "virtual"; throws std::invalid_argument.
BackendKind ParseBackendKind(const std::string& name);
std::string BackendName(BackendKind kind);

}  // namespace kvcache
