#include "kvcache/block_key.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

namespace kvcache {
namespace {

std::vector<TokenId> Iota(std::int32_t n, TokenId first = 0) {
  std::vector<TokenId> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = first + i;
  return v;
}

std::uint64_t Chain(std::uint64_t parent, const std::vector<TokenId>& t, std::uint64_t digest = 0) {
  return ChainHash(parent, t.data(), static_cast<std::int32_t>(t.size()), digest);
}

std::vector<std::uint64_t> Hashes(const std::vector<TokenId>& t, std::int32_t tpb,
                                  const ReuseExtras& extras) {
  std::vector<std::uint64_t> out;
  ChainHashes(t.data(), t.size(), tpb, extras, &out);
  return out;
}

// Digest of a lone item of `length` tokens at `offset` from a block start (it must reach into
// the block: length > -offset), built independently of any spanning.
std::uint64_t LoneItemDigest(std::uint64_t hash, std::int32_t offset, std::int32_t length) {
  ReuseExtras e;
  const std::int32_t block_start = offset < 0 ? -offset : 0;
  e.multimodal.push_back({hash, block_start + offset, length});
  return BlockExtrasDigest(e, 1, block_start, 4);
}

TEST(BlockKeyTest, HashTokensIsDeterministicSeededAndLengthAware) {
  const std::vector<TokenId> t = Iota(37, 100);
  EXPECT_EQ(HashTokens(5, t.data(), t.size()), HashTokens(5, t.data(), t.size()));
  EXPECT_NE(HashTokens(5, t.data(), t.size()), HashTokens(6, t.data(), t.size()));
  EXPECT_NE(HashTokens(0, nullptr, 0), HashTokens(1, nullptr, 0));
  // A trailing zero token is not the same as the zero padding of a shorter input.
  const std::vector<TokenId> z = {1, 2, 0, 0};
  std::set<std::uint64_t> seen;
  for (std::size_t n = 0; n <= z.size(); ++n) seen.insert(HashTokens(9, z.data(), n));
  EXPECT_EQ(seen.size(), 5u);
  // Every prefix length 0..37 (all lane and tail paths) hashes differently.
  seen.clear();
  for (std::size_t n = 0; n <= t.size(); ++n) seen.insert(HashTokens(9, t.data(), n));
  EXPECT_EQ(seen.size(), t.size() + 1);
}

TEST(BlockKeyTest, ChainHashSameInputSameHash) {
  const std::vector<TokenId> t = Iota(32);
  EXPECT_EQ(Chain(0, t), Chain(0, t));
  EXPECT_EQ(Chain(42, t, 7), Chain(42, t, 7));
  const std::vector<TokenId> copy = t;
  EXPECT_EQ(Chain(42, t, 7), Chain(42, copy, 7));
}

TEST(BlockKeyTest, ChainHashCoversEveryTokenOrderLengthParentAndDigest) {
  const std::vector<TokenId> t = Iota(37, 1000);
  const std::uint64_t base = Chain(0, t);
  // Changing any one token, at any position, changes the hash.
  for (std::size_t i = 0; i < t.size(); ++i) {
    std::vector<TokenId> u = t;
    u[i] += 1;
    EXPECT_NE(Chain(0, u), base) << "token " << i;
  }
  std::vector<TokenId> swapped = t;
  std::swap(swapped[3], swapped[4]);
  EXPECT_NE(Chain(0, swapped), base);
  std::vector<TokenId> shorter(t.begin(), t.end() - 1);
  EXPECT_NE(Chain(0, shorter), base);
  EXPECT_NE(Chain(1, t), base);
  EXPECT_NE(Chain(0, t, 1), base);
  EXPECT_NE(Chain(0, t, 1), Chain(0, t, 2));
  // The same two tokens in two single-token blocks differ from one two-token block.
  const TokenId ab[2] = {5, 6};
  EXPECT_NE(ChainHash(ChainHash(0, ab, 1, 0), ab + 1, 1, 0), ChainHash(0, ab, 2, 0));
}

TEST(BlockKeyTest, ChainHashNeverZero) {
  EXPECT_NE(ChainHash(0, nullptr, 0, 0), 0u);
  EXPECT_NE(ChainHash(0, nullptr, -3, 0), 0u);
  EXPECT_EQ(ChainHash(0, nullptr, -3, 0), ChainHash(0, nullptr, 0, 0));
  const TokenId zero[4] = {0, 0, 0, 0};
  for (std::int32_t n = 0; n <= 4; ++n) EXPECT_NE(ChainHash(0, zero, n, 0), 0u);
}

TEST(BlockKeyTest, NoExtrasDigestIsZero) {
  ReuseExtras e;
  EXPECT_EQ(BlockExtrasDigest(e, 0, 0, 4), 0u);
  EXPECT_EQ(BlockExtrasDigest(e, 3, 12, 4), 0u);
  e.multimodal.push_back({77, 8, 4});  // not in [0, 4)
  EXPECT_EQ(BlockExtrasDigest(e, 0, 0, 4), 0u);
  EXPECT_FALSE(HasMultimodal(e, 0, 4));
  EXPECT_NE(BlockExtrasDigest(e, 2, 8, 4), 0u);
}

TEST(BlockKeyTest, LoraNoneZeroAndOneDifferInEveryBlock) {
  ReuseExtras none, zero, one;
  zero.lora_task_id = 0;
  one.lora_task_id = 1;
  for (std::int32_t b = 0; b < 3; ++b) {
    const std::uint64_t dn = BlockExtrasDigest(none, b, 4 * b, 4);
    const std::uint64_t d0 = BlockExtrasDigest(zero, b, 4 * b, 4);
    const std::uint64_t d1 = BlockExtrasDigest(one, b, 4 * b, 4);
    EXPECT_EQ(dn, 0u);
    EXPECT_NE(d0, 0u);
    EXPECT_NE(d0, d1);
  }
  // LoRA and salt of the same value are different keys.
  ReuseExtras salt_one;
  salt_one.cache_salt = 1;
  EXPECT_NE(BlockExtrasDigest(salt_one, 0, 0, 4), BlockExtrasDigest(one, 0, 0, 4));
}

TEST(BlockKeyTest, SaltOnlyInFirstDigestButChangesWholeChain) {
  ReuseExtras none, zero, one;
  zero.cache_salt = 0;
  one.cache_salt = 1;
  const std::uint64_t dn = BlockExtrasDigest(none, 0, 0, 4);
  const std::uint64_t d0 = BlockExtrasDigest(zero, 0, 0, 4);
  const std::uint64_t d1 = BlockExtrasDigest(one, 0, 0, 4);
  EXPECT_EQ(dn, 0u);
  EXPECT_NE(d0, 0u);
  EXPECT_NE(d1, 0u);
  EXPECT_NE(d0, d1);
  for (std::int32_t b = 1; b < 3; ++b) {
    EXPECT_EQ(BlockExtrasDigest(zero, b, 4 * b, 4), 0u);
    EXPECT_EQ(BlockExtrasDigest(one, b, 4 * b, 4), 0u);
  }
  const std::vector<TokenId> t = Iota(10);
  const auto hn = Hashes(t, 4, none);
  const auto h0 = Hashes(t, 4, zero);
  const auto h1 = Hashes(t, 4, one);
  ASSERT_EQ(hn.size(), 3u);
  for (std::size_t i = 0; i < hn.size(); ++i) {
    EXPECT_NE(hn[i], h0[i]) << i;
    EXPECT_NE(hn[i], h1[i]) << i;
    EXPECT_NE(h0[i], h1[i]) << i;
  }
  EXPECT_EQ(Hashes(t, 4, one), h1);
}

TEST(BlockKeyTest, MultimodalHashAndOffsetMatterOrderDoesNot) {
  ReuseExtras a, b, c, d;
  a.multimodal = {{11, 1, 2}, {22, 3, 6}};
  b.multimodal = {{22, 3, 6}, {11, 1, 2}};  // same items, other order
  c.multimodal = {{11, 1, 2}, {23, 3, 6}};  // other hash
  d.multimodal = {{11, 2, 2}, {22, 3, 6}};  // other offset
  const std::uint64_t da = BlockExtrasDigest(a, 0, 0, 4);
  EXPECT_NE(da, 0u);
  EXPECT_EQ(BlockExtrasDigest(b, 0, 0, 4), da);
  EXPECT_NE(BlockExtrasDigest(c, 0, 0, 4), da);
  EXPECT_NE(BlockExtrasDigest(d, 0, 0, 4), da);
  // A duplicated item does not cancel out, and a second item does count.
  ReuseExtras one, two_same;
  one.multimodal = {{11, 1, 2}};
  two_same.multimodal = {{11, 1, 2}, {11, 1, 2}};
  EXPECT_NE(BlockExtrasDigest(two_same, 0, 0, 4), BlockExtrasDigest(one, 0, 0, 4));
  EXPECT_NE(BlockExtrasDigest(two_same, 0, 0, 4), 0u);
  EXPECT_NE(BlockExtrasDigest(one, 0, 0, 4), da);
  const std::vector<TokenId> t = Iota(9);
  EXPECT_EQ(Hashes(t, 4, a), Hashes(t, 4, b));
  EXPECT_NE(Hashes(t, 4, a)[0], Hashes(t, 4, c)[0]);
}

TEST(BlockKeyTest, MultimodalLengthMatters) {
  // The same content at the same start over 13 positions and over 2: block 0 holds the item's
  // positions in both, but different KV (the stale reads), so its key differs.
  ReuseExtras long_item, short_item, same;
  long_item.multimodal = {{0x5eed, 0, 13}};
  short_item.multimodal = {{0x5eed, 0, 2}};
  same.multimodal = {{0x5eed, 0, 13}};
  EXPECT_NE(BlockExtrasDigest(long_item, 0, 0, 4), BlockExtrasDigest(short_item, 0, 0, 4));
  EXPECT_EQ(BlockExtrasDigest(long_item, 0, 0, 4), BlockExtrasDigest(same, 0, 0, 4));
  const std::vector<TokenId> t = Iota(16);
  const auto h_long = Hashes(t, 4, long_item);
  const auto h_short = Hashes(t, 4, short_item);
  for (std::size_t i = 0; i < h_long.size(); ++i) EXPECT_NE(h_long[i], h_short[i]) << i;
  EXPECT_EQ(Hashes(t, 4, same), h_long);
  // Every length from 1 to 12 of an item starting 2 tokens into a block gives its own digest.
  std::set<std::uint64_t> distinct;
  for (std::int32_t length = 1; length <= 12; ++length) distinct.insert(LoneItemDigest(7, 2, length));
  EXPECT_EQ(distinct.size(), 12u);
}

TEST(BlockKeyTest, HashBytesIsDeterministicSeededAndSeesEveryByte) {
  std::vector<unsigned char> bytes(203);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 31 + 7);
  const std::uint64_t h = HashBytes(1, bytes.data(), bytes.size());
  EXPECT_EQ(HashBytes(1, bytes.data(), bytes.size()), h);
  EXPECT_NE(HashBytes(2, bytes.data(), bytes.size()), h);
  // Flipping one bit anywhere (the 64-byte lanes, the 16-byte groups, the tail) changes it,
  // and so does the length alone (zero padding is not zero bytes).
  std::set<std::uint64_t> seen{h};
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] ^= 0x10;
    seen.insert(HashBytes(1, bytes.data(), bytes.size()));
    bytes[i] ^= 0x10;
  }
  EXPECT_EQ(seen.size(), bytes.size() + 1);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_NE(HashBytes(1, zeros.data(), 31), HashBytes(1, zeros.data(), 32));
}

TEST(BlockKeyTest, ItemSpanningTwoBlocksAppearsInBothWithRelativeOffsets) {
  ReuseExtras e;
  e.multimodal = {{99, 6, 4}};  // tokens [6, 10); blocks of 4: [4, 8) and [8, 12)
  EXPECT_FALSE(HasMultimodal(e, 0, 4));
  EXPECT_TRUE(HasMultimodal(e, 4, 4));
  EXPECT_TRUE(HasMultimodal(e, 8, 4));
  EXPECT_FALSE(HasMultimodal(e, 12, 4));
  EXPECT_EQ(BlockExtrasDigest(e, 0, 0, 4), 0u);
  EXPECT_EQ(BlockExtrasDigest(e, 1, 4, 4), LoneItemDigest(99, 2, 4));
  EXPECT_EQ(BlockExtrasDigest(e, 2, 8, 4), LoneItemDigest(99, -2, 4));
  std::set<std::uint64_t> distinct;  // every (hash, offset) pair gives its own digest
  for (std::uint64_t hash = 1; hash <= 8; ++hash) {
    for (std::int32_t offset = -8; offset <= 3; ++offset) {  // blocks are 4 tokens long
      distinct.insert(LoneItemDigest(hash, offset, 9));
    }
  }
  EXPECT_EQ(distinct.size(), 8u * 12u);
  EXPECT_EQ(BlockExtrasDigest(e, 3, 12, 4), 0u);
  // Ends are exclusive: [4, 8) touches only block 1, and a 0-length item touches nothing.
  ReuseExtras exact;
  exact.multimodal = {{99, 4, 4}, {98, 9, 0}};
  EXPECT_FALSE(HasMultimodal(exact, 0, 4));
  EXPECT_TRUE(HasMultimodal(exact, 4, 4));
  EXPECT_FALSE(HasMultimodal(exact, 8, 4));
  EXPECT_EQ(BlockExtrasDigest(exact, 1, 4, 4), LoneItemDigest(99, 0, 4));
}

TEST(BlockKeyTest, ChainHashesEqualsManualChainingWithPartialLastBlock) {
  ReuseExtras e;
  e.lora_task_id = 3;
  e.cache_salt = 12345;
  e.multimodal = {{7, 5, 6}, {8, 0, 1}, {9, 17, 3}};  // the last runs past the 18 tokens
  const std::vector<TokenId> t = Iota(18, 50);
  const auto got = Hashes(t, 4, e);
  ASSERT_EQ(got.size(), 5u);  // 4 + 4 + 4 + 4 + 2
  std::uint64_t parent = 0;
  for (std::int32_t b = 0; b < 5; ++b) {
    const std::int32_t start = 4 * b;
    const std::int32_t len = std::min(4, 18 - start);
    const std::uint64_t digest = BlockExtrasDigest(e, b, start, len);
    parent = ChainHash(parent, t.data() + start, len, digest);
    EXPECT_EQ(got[static_cast<std::size_t>(b)], parent) << "block " << b;
  }
  // Without extras too, and with one block exactly full.
  const auto plain = Hashes(Iota(8), 8, ReuseExtras{});
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_EQ(plain[0], Chain(0, Iota(8)));
  // The full blocks of a longer prompt keep their hashes; only the partial one changes.
  const auto longer = Hashes(Iota(19, 50), 4, e);
  EXPECT_EQ(std::vector<std::uint64_t>(longer.begin(), longer.begin() + 4),
            std::vector<std::uint64_t>(got.begin(), got.begin() + 4));
  EXPECT_NE(longer[4], got[4]);
}

TEST(BlockKeyTest, ChainHashesEmptyInputAndInvalidArguments) {
  std::vector<std::uint64_t> out = {1, 2, 3};
  ChainHashes(nullptr, 0, 4, ReuseExtras{}, &out);
  EXPECT_TRUE(out.empty());
  const std::vector<TokenId> t = Iota(8);
  EXPECT_THROW(ChainHashes(t.data(), t.size(), 0, ReuseExtras{}, &out), std::invalid_argument);
  EXPECT_THROW(ChainHashes(t.data(), t.size(), 4, ReuseExtras{}, nullptr), std::invalid_argument);
  ReuseExtras bad;
  bad.multimodal = {{1, -1, 2}};
  EXPECT_THROW(ChainHashes(t.data(), t.size(), 4, bad, &out), std::invalid_argument);
  EXPECT_THROW(BlockExtrasDigest(bad, 0, 0, 4), std::invalid_argument);
  bad.multimodal = {{1, 0, -2}};
  EXPECT_THROW(HasMultimodal(bad, 0, 4), std::invalid_argument);
  EXPECT_THROW(BlockExtrasDigest(ReuseExtras{}, 0, 0, -1), std::invalid_argument);
}

// Chi-square statistic of `hashes` over 65,536 buckets chosen by (h >> shift) & 0xffff.
double ChiSquare16(const std::vector<std::uint64_t>& hashes, int shift) {
  std::vector<std::uint32_t> buckets(65536, 0);
  for (std::uint64_t h : hashes) ++buckets[(h >> shift) & 0xffff];
  const double expected = static_cast<double>(hashes.size()) / 65536.0;
  double chi2 = 0;
  for (std::uint32_t c : buckets) chi2 += (c - expected) * (c - expected) / expected;
  return chi2;
}

TEST(BlockKeyTest, DistributionNoCollisionsAndUniformBuckets) {
  // 100,000 random 32-token blocks and 100,000 low-entropy ones (a single non-zero token,
  // small values), all distinct, as chain heads (parent 0, no extras).
  std::mt19937_64 rng(0x5eed1234);
  std::uniform_int_distribution<TokenId> token(0, 151935);
  std::vector<std::uint64_t> hashes;
  hashes.reserve(200000);
  std::vector<TokenId> block(32);
  for (int i = 0; i < 100000; ++i) {
    for (TokenId& x : block) x = token(rng);
    hashes.push_back(Chain(0, block));
  }
  for (int i = 0; i < 100000; ++i) {
    std::fill(block.begin(), block.end(), 0);
    block[static_cast<std::size_t>(i % 32)] = i / 32 + 1;
    hashes.push_back(Chain(0, block));
  }
  EXPECT_EQ(std::count(hashes.begin(), hashes.end(), 0u), 0);
  // 65,535 degrees of freedom: mean 65,535, standard deviation ~362. A good hash lands within
  // a few hundred of the mean (this one: 65,819 and 65,394). Summing the tokens instead gives
  // ~1.0e6 on the low bits, ~1.3e10 on the high bits and ~100,000 collisions.
  const double low = ChiSquare16(hashes, 0);
  const double high = ChiSquare16(hashes, 48);
  EXPECT_GT(low, 64000.0);
  EXPECT_LT(low, 67000.0);
  EXPECT_GT(high, 64000.0);
  EXPECT_LT(high, 67000.0);
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::adjacent_find(hashes.begin(), hashes.end()), hashes.end()) << "64-bit collision";
}

}  // namespace
}  // namespace kvcache
