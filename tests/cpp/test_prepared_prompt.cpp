// PreparedPrompt: a prompt converted and keyed once behaves exactly like the raw prompt in every
// call that takes one, and stores chains that raw lookups find.
#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

KVCacheManager Manager(std::int32_t tpb = 4) {
  ManagerConfig c = Config({8, 0}, 64, {{8, 20}, {64, 20}}, tpb, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  return KVCacheManager(Model(2), c);
}

TEST(PreparedPromptTest, KeysEveryFullBlockOnce) {
  KVCacheManager m = Manager();
  ReuseExtras extras;
  extras.lora_task_id = 3;
  const auto tokens = Iota(10);
  const PreparedPrompt p = m.Prepare(tokens.data(), tokens.size(), extras);
  EXPECT_EQ(p.tokens, tokens);
  EXPECT_EQ(p.tokens_per_block, 4);
  ASSERT_EQ(p.hashes.size(), 2u);  // two full blocks; the partial third is keyed when stored
  std::vector<std::uint64_t> chain;
  ChainHashes(tokens.data(), 8, 4, extras, &chain);
  EXPECT_EQ(p.hashes, chain);
  EXPECT_EQ(p.digests[1], BlockExtrasDigest(extras, 1, 4, 4));
}

TEST(PreparedPromptTest, SameAnswersAsTheRawPromptAndStoresWhatRawLookupsFind) {
  KVCacheManager m = Manager();
  const auto first = Iota(13);
  const PreparedPrompt p1 = m.Prepare(first.data(), first.size(), {});
  EXPECT_EQ(m.GetReusablePrefixLength(p1), 0);
  EXPECT_EQ(m.GetNumBlocksToAllocate(p1, 5), m.GetNumBlocksToAllocate(first.data(), first.size(), {}, 5));
  EXPECT_EQ(m.AddSequence(1, p1, {}, 5), 0);
  EXPECT_EQ(m.NumTokens(1), 5);
  m.Prefill(1, 8);
  EXPECT_EQ(m.StoreContextBlocks(1), 3);  // stored with the prepared hashes
  EXPECT_EQ(m.GetReusablePrefixLength(first.data(), first.size(), {}), 12);  // found by a raw lookup
  auto longer = Iota(20);
  const PreparedPrompt p2 = m.Prepare(longer.data(), longer.size(), {});
  EXPECT_EQ(m.GetReusablePrefixLength(p2), 12);
  EXPECT_EQ(m.GetNumBlocksToAllocate(p2), m.GetNumBlocksToAllocate(longer.data(), longer.size(), {}));
  EXPECT_EQ(m.AddSequence(2, p2), 12);
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1, 2, 4, 5}));
  for (TokenId t = 0; t < 3; ++t) m.AddToken(2, 100 + t);
  m.RemoveSequence(2);  // 22 key tokens: 4 prompt blocks from the prepared hashes, the rest keyed now
  longer.insert(longer.end(), {100, 101, 102});
  EXPECT_EQ(m.GetReusablePrefixLength(longer.data(), longer.size(), {}), 22);
  m.CheckInvariants();
}

TEST(PreparedPromptTest, ASharedPromptIsKeptNotCopied) {
  // The sequence holds the shared prompt (one reference) until it ends; its first generated
  // token and a rewind copy the tokens, so the prompt itself never changes. (Full attention
  // only, so that the rewind may reach into the prompt.)
  ManagerConfig c = Config({0}, 64, {{64, 20}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(1), c);
  const auto tokens = Iota(10);
  auto p = std::make_shared<const PreparedPrompt>(m.Prepare(tokens.data(), tokens.size(), {}));
  std::weak_ptr<const PreparedPrompt> watch = p;
  EXPECT_EQ(m.AddSequence(1, p), 0);
  EXPECT_EQ(p.use_count(), 2);
  p.reset();  // the caller drops it: the sequence's copy-free prompt lives on
  EXPECT_EQ(watch.use_count(), 1);
  m.AddToken(1, 100);
  m.AddToken(1, 101);
  EXPECT_EQ(watch.lock()->tokens, tokens);  // unchanged by the appends
  m.Rewind(1, 3);                           // back into the prompt: 9 tokens
  m.AddToken(1, 200);
  m.CheckInvariants();
  m.RemoveSequence(1);  // stores 9 key tokens: 2 prepared full blocks, the third keyed now
  EXPECT_TRUE(watch.expired());
  auto expect = Iota(9);
  expect.push_back(200);
  EXPECT_EQ(m.GetReusablePrefixLength(expect.data(), expect.size(), {}), 9);
  EXPECT_EQ(m.GetReusablePrefixLength(tokens.data(), tokens.size(), {}), 9);  // token 9 is in no block key
  EXPECT_THROW(m.AddSequence(2, std::shared_ptr<const PreparedPrompt>{}), std::invalid_argument);
  EXPECT_FALSE(m.HasSequence(2));
  m.CheckInvariants();
}

TEST(PreparedPromptTest, ExtrasComeFromThePrompt) {
  KVCacheManager m = Manager();
  ReuseExtras lora;
  lora.lora_task_id = 7;
  const auto tokens = Iota(9);
  const PreparedPrompt p = m.Prepare(tokens.data(), tokens.size(), lora);
  SequenceOptions options;
  options.extras.lora_task_id = 8;  // ignored: the prepared prompt carries its own extras
  m.AddSequence(1, p, options);
  m.RemoveSequence(1);
  EXPECT_EQ(m.GetReusablePrefixLength(tokens.data(), tokens.size(), lora), 8);
  EXPECT_EQ(m.GetReusablePrefixLength(tokens.data(), tokens.size(), options.extras), 0);
  EXPECT_EQ(m.GetReusablePrefixLength(tokens.data(), tokens.size(), {}), 0);
}

TEST(PreparedPromptTest, RejectsBadPromptsAndForeignBlockSizes) {
  KVCacheManager m = Manager();
  const std::vector<TokenId> bad = {1, -2};
  EXPECT_THROW(m.Prepare(bad.data(), bad.size(), {}), std::invalid_argument);
  EXPECT_THROW(m.Prepare(bad.data(), 0, {}), std::invalid_argument);
  const auto too_long = Iota(65);
  EXPECT_THROW(m.Prepare(too_long.data(), too_long.size(), {}), std::invalid_argument);
  KVCacheManager other = Manager(8);
  const auto tokens = Iota(9);
  const PreparedPrompt p = other.Prepare(tokens.data(), tokens.size(), {});
  EXPECT_THROW(m.AddSequence(1, p), std::invalid_argument);
  EXPECT_THROW(m.GetReusablePrefixLength(p), std::invalid_argument);
  EXPECT_THROW(m.GetNumBlocksToAllocate(p), std::invalid_argument);
  EXPECT_EQ(m.NumSequences(), 0u);
}

}  // namespace
}  // namespace kvcache
