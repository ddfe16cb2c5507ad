// Block keys for prefix reuse: a fast seeded token hash, the digest of a block's extra keys
// (LoRA task id, cache salt, multimodal items) and the chained 64-bit hash of a block key.
//
// A block key is (parent's chained hash, token count, tokens, extras digest); its chained hash
// therefore covers the block's whole prefix, so a lookup never re-hashes earlier blocks. All
// hashes operate on values, never on bytes: they are the same on every platform and endianness.
// They are not cryptographic; they are built for speed and distribution, not to resist attackers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

/// A multimodal input (image, audio clip, ...) occupying the token range [start, start + length).
struct MultimodalItem {
  std::uint64_t hash;  ///< Content hash of the item, computed by the caller.
  std::int32_t start;  ///< First token position of the item; must be >= 0.
  std::int32_t length;  ///< Number of token positions; must be >= 0 (0 overlaps nothing).
};

/// Extra keys of a request that take part in its block keys besides the tokens.
struct ReuseExtras {
  std::optional<std::int64_t> lora_task_id;  ///< nullopt = no LoRA (differs from LoRA 0).
  std::optional<std::uint64_t> cache_salt;   ///< nullopt = no salt (differs from salt 0).
  std::vector<MultimodalItem> multimodal;    ///< Any order; the digests do not depend on it.
};

/// Fast, well-distributed 64-bit hash of `n` token ids, seeded. Covers `n` as well, so inputs
/// that differ only by trailing zero tokens hash differently. Different seeds give unrelated
/// hashes.
std::uint64_t HashTokens(std::uint64_t seed, const TokenId* tokens, std::size_t n) noexcept;

/// Fast 64-bit checksum of `n` bytes, seeded (the disk tier's per-block check). Unlike the
/// token hashes it reads the bytes in the machine's byte order: for checksums written and
/// verified by the same machine. Not cryptographic: it catches corruption, not attackers.
std::uint64_t HashBytes(std::uint64_t seed, const void* data, std::size_t n) noexcept;

/// Digest of the extra keys of the block that covers tokens [start, start + n) and sits at chain
/// position `block_index`: the LoRA id (every block), the cache salt (block_index == 0 only: the
/// chain propagates it) and every multimodal item overlapping [start, start + n) as
/// (hash, item.start - start, item.length) (the offset to the block start, negative for an
/// item that began in an earlier block; the length, so the same content over fewer positions
/// is another key), independent of item order. Returns 0 exactly when there are none.
/// Throws std::invalid_argument if `n` < 0 or an item has a negative start or length.
std::uint64_t BlockExtrasDigest(const ReuseExtras& extras, std::int32_t block_index,
                                std::int32_t start, std::int32_t n);

/// True if any multimodal item overlaps [start, start + n). Throws std::invalid_argument like
/// BlockExtrasDigest.
bool HasMultimodal(const ReuseExtras& extras, std::int32_t start, std::int32_t n);

/// Chained hash of one block key: covers the parent's chained hash (0 for the root), the number
/// of tokens `n` (>= 0; a negative `n` is treated as 0), the tokens and the extras digest.
/// Never returns 0, which is reserved for "the root".
std::uint64_t ChainHash(std::uint64_t parent, const TokenId* tokens, std::int32_t n,
                        std::uint64_t extras_digest) noexcept;

/// Chained hashes of the blocks of tokens[0, n) cut into blocks of `tokens_per_block` (the last
/// may be partial), starting from the root (parent 0): out[i] = ChainHash(out[i - 1] or 0,
/// block i, BlockExtrasDigest(extras, i, i * tokens_per_block, size of block i)). Clears *out,
/// then appends ceil(n / tokens_per_block) hashes. Throws std::invalid_argument if
/// `tokens_per_block` <= 0, `n` > INT32_MAX, `out` is null, or an item is invalid.
void ChainHashes(const TokenId* tokens, std::size_t n, std::int32_t tokens_per_block,
                 const ReuseExtras& extras, std::vector<std::uint64_t>* out);

}  // namespace kvcache
