// Seeded randomized operations with check_invariants after every one, over several window
// configurations; failing calls must leave every observable value unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

struct Case {
  std::vector<std::int32_t> pattern;
  std::int32_t max_seq_len;
  std::map<WindowSize, std::int32_t> blocks;
  std::int32_t tpb;
  std::int32_t draft;
};

class RandomizedTest : public ::testing::TestWithParam<Case> {};

TEST_P(RandomizedTest, InvariantsHoldAfterEveryOperation) {
  const Case& c = GetParam();
  ManagerConfig config = testing::Config(c.pattern, c.max_seq_len, c.blocks, c.tpb, BackendKind::kVirtual);
  config.max_draft_tokens = c.draft;
  KVCacheManager m(testing::Model(static_cast<std::int32_t>(std::max<std::size_t>(c.pattern.size(), 1))), config);
  std::mt19937 rng(1234u + static_cast<unsigned>(c.tpb));
  std::map<SeqId, std::int32_t> live;  // expected token counts
  SeqId next_id = 0;
  std::vector<SeqId> ids_for_snapshot;
  int failures = 0;
  int successes = 0;
  auto pick = [&]() {
    auto it = live.begin();
    std::advance(it, std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
    return it->first;
  };
  for (int op = 0; op < 4000; ++op) {
    ids_for_snapshot.assign({});
    for (const auto& kv : live) ids_for_snapshot.push_back(kv.first);
    const auto before = testing::Take(m, ids_for_snapshot);
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    bool threw = false;
    try {
      if (kind <= 2 || live.empty()) {
        const auto len = std::uniform_int_distribution<std::int32_t>(1, c.max_seq_len / 2)(rng);
        const SeqId id = next_id++;
        auto tokens = testing::Iota(len, static_cast<TokenId>(id));
        m.AddSequence(id, tokens.data(), tokens.size());
        live[id] = len;
      } else if (kind <= 6) {
        std::vector<SeqId> batch;
        for (const auto& kv : live) {
          if (kv.second < c.max_seq_len && rng() % 3 != 0) batch.push_back(kv.first);
        }
        std::vector<TokenId> toks(batch.size(), 7);
        m.AddTokens(batch.data(), toks.data(), batch.size());
        for (auto id : batch) ++live[id];
      } else if (kind == 7) {
        const SeqId id = pick();
        const auto n = std::uniform_int_distribution<std::int32_t>(0, std::max(0, std::min(c.draft + 1, live[id] - 1)))(rng);
        m.Rewind(id, n);
        live[id] -= n;
      } else {
        const SeqId id = pick();
        m.RemoveSequence(id);
        live.erase(id);
      }
      ++successes;
    } catch (const OutOfBlocksError&) {
      threw = true;
    } catch (const std::invalid_argument&) {
      threw = true;  // a rewind into released blocks
    }
    if (threw) {
      ++failures;
      ASSERT_EQ(testing::Take(m, ids_for_snapshot), before) << "failed op " << op << " changed state";
    }
    ASSERT_NO_THROW(m.CheckInvariants()) << "after op " << op;
    ASSERT_EQ(m.NumSequences(), live.size());
    for (const auto& [id, n] : live) ASSERT_EQ(m.NumTokens(id), n);
  }
  EXPECT_GT(successes, 2000);
  EXPECT_GT(failures, 0) << "the pools should run out sometimes";
  for (const auto& kv : live) m.RemoveSequence(kv.first);
  for (const auto& [w, n] : c.blocks) EXPECT_EQ(m.GetNumFreeBlocks(w), n);
  m.CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(
    Windows, RandomizedTest,
    ::testing::Values(Case{{8, 16, 0}, 64, {{8, 24}, {16, 30}, {64, 60}}, 4, 0},
                      Case{{3}, 40, {{3, 20}}, 4, 0},
                      Case{{5, 0}, 48, {{5, 40}, {48, 50}}, 2, 2},
                      Case{{0}, 32, {{32, 40}}, 8, 0},
                      Case{{16, 16, 32, 0}, 128, {{16, 20}, {32, 30}, {128, 80}}, 16, 3}),
    [](const ::testing::TestParamInfo<Case>& param) { return "case" + std::to_string(param.index); });

}  // namespace
}  // namespace kvcache
