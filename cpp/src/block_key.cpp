#include "kvcache/block_key.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

__extension__ typedef unsigned __int128 U128;  // g++/clang extension; silences -Wpedantic.

// Odd constants drawn once from a seeded PRNG (Python random.Random(20240604)), with 29-35 bits
// set and bits 31 and 63 always set.
// A 64-bit word packed from two non-negative token ids has bits 31 and 63 clear, so XORing it
// with one of these never gives 0 and the multiply it feeds never wipes the state; the upper
// half is non-zero too, so the same holds for any 32-bit value.
constexpr std::uint64_t kSeedA = 0xc1cc8c4cd93f7849ULL;
constexpr std::uint64_t kSeedB = 0x8f4a5088f457dc91ULL;
constexpr std::uint64_t kLane[4] = {0xe34c0250f4f7a2b7ULL, 0x8592f434a0baf145ULL,
                                    0xd2186dbcaba0eac1ULL, 0x94b639d99e6a3201ULL};
constexpr std::uint64_t kMul[4] = {0x83ec9b88e392496dULL, 0x8c0212efd8d90f55ULL,
                                   0xc64829f1fa01cca7ULL, 0x8642976abb3e786fULL};
constexpr std::uint64_t kMergeA = 0xd2868a8de53864f5ULL;
constexpr std::uint64_t kMergeB = 0xf306fe558138b107ULL;
constexpr std::uint64_t kMergeC = 0xe4a544fdc9c2cc09ULL;
constexpr std::uint64_t kMergeD = 0xd72b654c9b53543fULL;
constexpr std::uint64_t kLenA = 0xd85f6dc391831261ULL;
constexpr std::uint64_t kLenB = 0xf7079aaee21d7459ULL;
constexpr std::uint64_t kFinal = 0x9b2dad38fd8333a9ULL;
constexpr std::uint64_t kFinalMul = 0x86fd4d9fe14050b7ULL;
// Extras: one tag per field, so equal values in different fields never collide.
constexpr std::uint64_t kTagLora = 0xb30c80ef8143ed0bULL;
constexpr std::uint64_t kTagSalt = 0xd0086b4b995ed535ULL;
constexpr std::uint64_t kTagMmSum = 0x8a1f03fcf52d60d3ULL;
constexpr std::uint64_t kTagMmCount = 0xa4508f039cd3f62bULL;
constexpr std::uint64_t kTagItem = 0xc3977540eddeb407ULL;
// Added later, by the same rules (odd, 32 bits set, bits 31 and 63 set): an item's length.
constexpr std::uint64_t kTagItemLength = 0xa6e1b0f3c58d2a47ULL;
constexpr std::uint64_t kHalfLo = 0x8dc9d40791017ebdULL;
constexpr std::uint64_t kHalfHi = 0x870da2019b6d791dULL;
constexpr std::uint64_t kDigestSeed = 0x964584bc8f596069ULL;
constexpr std::uint64_t kDigestA = 0xdab496eeba8b152bULL;
constexpr std::uint64_t kDigestB = 0x8ded9a3a8ce2c837ULL;
// Substitute for a result that happens to be 0 (0 means "root" or "no extras").
constexpr std::uint64_t kNonZero = 0xe2dfc7f4e1104095ULL;

/// 64x64 -> 128-bit multiply, folded to 64 bits by XORing the halves.
inline std::uint64_t Mum(std::uint64_t a, std::uint64_t b) noexcept {
  const U128 p = static_cast<U128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
}

inline std::uint64_t U32(TokenId t) noexcept {
  return static_cast<std::uint32_t>(t);
}

/// Two tokens as one word, by value: t[0] in the low half, t[1] in the high half.
inline std::uint64_t Word(const TokenId* t) noexcept {
  return U32(t[0]) | (U32(t[1]) << 32);
}

/// Absorbs four tokens into one lane.
inline std::uint64_t Round(std::uint64_t lane, const TokenId* t, std::uint64_t k) noexcept {
  return Mum(lane ^ Word(t), Word(t + 2) ^ k);
}

/// Eight bytes as one word, in the machine's byte order (HashBytes is for local checksums).
inline std::uint64_t Load(const unsigned char* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// Absorbs a 64-bit value into `h`, half by half so that no value can cancel the state.
inline std::uint64_t Absorb(std::uint64_t h, std::uint64_t tag, std::uint64_t v) noexcept {
  h = Mum(h ^ tag, (v & 0xffffffffULL) ^ kHalfLo);
  return Mum(h ^ kMergeA, (v >> 32) ^ kHalfHi);
}

/// One item as a block sees it: its content hash, its start relative to the block and its
/// length (the same content over fewer positions is a different input to those positions).
std::uint64_t ItemDigest(std::uint64_t hash, std::int64_t offset, std::int32_t length) noexcept {
  std::uint64_t h = Absorb(kDigestSeed, kTagItem, static_cast<std::uint64_t>(offset));
  h = Absorb(h, kTagItemLength, static_cast<std::uint64_t>(length));
  return Absorb(h, kTagItem, hash);
}

void ValidateItems(const ReuseExtras& extras) {
  for (const MultimodalItem& item : extras.multimodal) {
    if (item.start < 0 || item.length < 0) {
      ThrowInvalid("multimodal item with start ", item.start, " and length ", item.length,
                   ": both must be >= 0");
    }
  }
}

inline bool Overlaps(const MultimodalItem& item, std::int32_t start, std::int32_t n) noexcept {
  const std::int64_t b0 = start;
  const std::int64_t b1 = b0 + n;
  const std::int64_t i0 = item.start;
  const std::int64_t i1 = i0 + item.length;
  return n > 0 && item.length > 0 && i0 < b1 && b0 < i1;
}

/// The digest from its parts; `mm_sum` is the wrapping sum of ItemDigest over the `mm_count`
/// overlapping items.
std::uint64_t Digest(const ReuseExtras& extras, std::int32_t block_index, std::uint64_t mm_sum,
                     std::uint64_t mm_count) noexcept {
  const bool salt = block_index == 0 && extras.cache_salt.has_value();
  if (!extras.lora_task_id.has_value() && !salt && mm_count == 0) return 0;
  std::uint64_t h = kDigestSeed;
  if (extras.lora_task_id) {
    h = Absorb(h, kTagLora, static_cast<std::uint64_t>(*extras.lora_task_id));
  }
  if (salt) h = Absorb(h, kTagSalt, *extras.cache_salt);
  if (mm_count != 0) {
    h = Absorb(h, kTagMmCount, mm_count);
    h = Absorb(h, kTagMmSum, mm_sum);
  }
  h = Mum(h ^ kFinal, kDigestA);
  return h != 0 ? h : kNonZero;
}

}  // namespace

std::uint64_t HashTokens(std::uint64_t seed, const TokenId* tokens, std::size_t n) noexcept {
  const std::uint64_t s = Mum(seed ^ kSeedA, kSeedB);
  std::uint64_t a = s ^ kLane[0];
  std::uint64_t b = s ^ kLane[1];
  std::uint64_t c = s ^ kLane[2];
  std::uint64_t d = s ^ kLane[3];
  const TokenId* p = tokens;
  std::size_t left = n;
  // Four independent lanes of four tokens each: the multiplies overlap in the pipeline.
  while (left >= 16) {
    a = Round(a, p, kMul[0]);
    b = Round(b, p + 4, kMul[1]);
    c = Round(c, p + 8, kMul[2]);
    d = Round(d, p + 12, kMul[3]);
    p += 16;
    left -= 16;
  }
  // Up to three groups of four into lanes a, b, c; then up to three tokens into lane d.
  if (left >= 4) {
    a = Round(a, p, kMul[0]);
    if (left >= 8) b = Round(b, p + 4, kMul[1]);
    if (left >= 12) c = Round(c, p + 8, kMul[2]);
    const std::size_t groups = left / 4;
    p += groups * 4;
    left -= groups * 4;
  }
  if (left > 0) {
    const std::uint64_t w0 = U32(p[0]) | (left > 1 ? U32(p[1]) << 32 : 0);
    const std::uint64_t w1 = left > 2 ? U32(p[2]) : 0;
    d = Mum(d ^ w0, w1 ^ kMul[3]);
  }
  // Merge the lanes, then the length (which also tells zero padding from zero tokens).
  std::uint64_t h = Mum(a ^ kMergeA, b ^ kMergeB) ^ Mum(c ^ kMergeC, d ^ kMergeD);
  h = Mum(h ^ kLenA, static_cast<std::uint64_t>(n) ^ kLenB);
  return Mum(h ^ kFinal, kFinalMul);
}

std::uint64_t HashBytes(std::uint64_t seed, const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::uint64_t s = Mum(seed ^ kSeedA, kSeedB);
  std::uint64_t a = s ^ kLane[0];
  std::uint64_t b = s ^ kLane[1];
  std::uint64_t c = s ^ kLane[2];
  std::uint64_t d = s ^ kLane[3];
  std::size_t left = n;
  // Four independent lanes of 16 bytes each, as in HashTokens.
  while (left >= 64) {
    a = Mum(a ^ Load(p), Load(p + 8) ^ kMul[0]);
    b = Mum(b ^ Load(p + 16), Load(p + 24) ^ kMul[1]);
    c = Mum(c ^ Load(p + 32), Load(p + 40) ^ kMul[2]);
    d = Mum(d ^ Load(p + 48), Load(p + 56) ^ kMul[3]);
    p += 64;
    left -= 64;
  }
  while (left >= 16) {
    a = Mum(a ^ Load(p), Load(p + 8) ^ kMul[0]);
    p += 16;
    left -= 16;
  }
  if (left > 0) {
    unsigned char tail[16] = {};
    std::memcpy(tail, p, left);
    d = Mum(d ^ Load(tail), Load(tail + 8) ^ kMul[3]);
  }
  std::uint64_t h = Mum(a ^ kMergeA, b ^ kMergeB) ^ Mum(c ^ kMergeC, d ^ kMergeD);
  h = Mum(h ^ kLenA, static_cast<std::uint64_t>(n) ^ kLenB);
  return Mum(h ^ kFinal, kFinalMul);
}

std::uint64_t BlockExtrasDigest(const ReuseExtras& extras, std::int32_t block_index,
                                std::int32_t start, std::int32_t n) {
  if (n < 0) ThrowInvalid("BlockExtrasDigest: n = ", n, " must be >= 0");
  ValidateItems(extras);
  std::uint64_t sum = 0;
  std::uint64_t count = 0;
  for (const MultimodalItem& item : extras.multimodal) {
    if (!Overlaps(item, start, n)) continue;
    sum += ItemDigest(item.hash, static_cast<std::int64_t>(item.start) - start, item.length);
    ++count;
  }
  return Digest(extras, block_index, sum, count);
}

bool HasMultimodal(const ReuseExtras& extras, std::int32_t start, std::int32_t n) {
  if (n < 0) ThrowInvalid("HasMultimodal: n = ", n, " must be >= 0");
  ValidateItems(extras);
  return std::any_of(extras.multimodal.begin(), extras.multimodal.end(),
                     [&](const MultimodalItem& item) { return Overlaps(item, start, n); });
}

std::uint64_t ChainHash(std::uint64_t parent, const TokenId* tokens, std::int32_t n,
                        std::uint64_t extras_digest) noexcept {
  // The digest's mix does not depend on the parent, so it stays off the chain's critical path.
  const std::uint64_t seed = parent ^ Mum(extras_digest ^ kDigestA, kDigestB);
  const std::uint64_t h = HashTokens(seed, tokens, n > 0 ? static_cast<std::size_t>(n) : 0);
  return h != 0 ? h : kNonZero;
}

void ChainHashes(const TokenId* tokens, std::size_t n, std::int32_t tokens_per_block,
                 const ReuseExtras& extras, std::vector<std::uint64_t>* out) {
  if (out == nullptr) ThrowInvalid("ChainHashes: out must not be null");
  if (tokens_per_block <= 0) {
    ThrowInvalid("ChainHashes: tokens_per_block = ", tokens_per_block, " must be > 0");
  }
  if (n > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    ThrowInvalid("ChainHashes: ", n, " tokens is more than INT32_MAX");
  }
  ValidateItems(extras);
  out->clear();
  const auto total = static_cast<std::int32_t>(n);
  const std::int32_t num_blocks = total / tokens_per_block + (total % tokens_per_block != 0);
  out->reserve(static_cast<std::size_t>(num_blocks));

  // Per-block multimodal sums, filled item by item over the blocks each item overlaps.
  std::vector<std::uint64_t> mm_sum;
  std::vector<std::uint64_t> mm_count;
  if (!extras.multimodal.empty()) {
    mm_sum.assign(static_cast<std::size_t>(num_blocks), 0);
    mm_count.assign(static_cast<std::size_t>(num_blocks), 0);
    for (const MultimodalItem& item : extras.multimodal) {
      if (item.length == 0 || item.start >= total) continue;
      const std::int64_t last_token = static_cast<std::int64_t>(item.start) + item.length - 1;
      const std::int32_t first = item.start / tokens_per_block;
      const auto last = static_cast<std::int32_t>(
          std::min<std::int64_t>(last_token / tokens_per_block, num_blocks - 1));
      for (std::int32_t b = first; b <= last; ++b) {
        const std::int64_t offset = static_cast<std::int64_t>(item.start) -
                                    static_cast<std::int64_t>(b) * tokens_per_block;
        mm_sum[static_cast<std::size_t>(b)] += ItemDigest(item.hash, offset, item.length);
        ++mm_count[static_cast<std::size_t>(b)];
      }
    }
  }

  // Without multimodal items the digest is the same for every block after the first.
  const std::uint64_t digest_first = Digest(extras, 0, 0, 0);
  const std::uint64_t digest_rest = Digest(extras, 1, 0, 0);
  std::uint64_t parent = 0;
  for (std::int32_t b = 0; b < num_blocks; ++b) {
    const std::int32_t start = b * tokens_per_block;
    const std::int32_t len = std::min(tokens_per_block, total - start);
    std::uint64_t digest = b == 0 ? digest_first : digest_rest;
    if (!mm_count.empty()) {
      const auto i = static_cast<std::size_t>(b);
      digest = Digest(extras, b, mm_sum[i], mm_count[i]);
    }
    parent = ChainHash(parent, tokens + start, len, digest);
    out->push_back(parent);
  }
}

}  // namespace kvcache
