// Seeded randomized operations with reuse on, priorities, a secondary pool (and, in three of
// the variants, a disk tier below it) and both sliding window reuse policies, over windows
// {8, 16, full}. After every operation the invariants hold;
// a failing call changes nothing; and on the host backend every reused token position holds
// exactly the KV written for that token prefix (K and V are tagged with a hash of the prefix).
// In the disk_faults variant the tier's files are corrupted and truncated under the manager
// between operations: a block that does not read back intact must be a miss, never wrong KV.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

constexpr std::int32_t kTpb = 4;
constexpr std::int32_t kMaxSeqLen = 64;

struct Live {
  std::vector<TokenId> tokens;
  std::vector<std::uint32_t> tag;  // per position: hash of the token prefix (and LoRA)
  std::optional<std::int64_t> lora;
};

std::uint32_t Mix(std::uint32_t h, std::uint32_t v) {
  std::uint64_t x = (static_cast<std::uint64_t>(h) << 32 | v) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return static_cast<std::uint32_t>(x >> 32) | 1u;  // never 0 (fresh memory is 0)
}

struct Variant {
  SwaReusePolicy policy;
  std::int32_t disk_blocks;  ///< Disk-tier blocks per window (0: no disk tier).
  bool disk_faults = false;  ///< Corrupt and truncate the tier's files between operations.
  int ops = 10000;
};

/// XORs a random byte of a random window file of the tier in `dir` (one time in four, truncates
/// the file to a random length instead; later spills extend it again, with a hole).
void InjectDiskFault(const std::string& dir, std::mt19937* rng) {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".kvblocks") files.push_back(e.path());
  }
  if (files.empty()) return;
  std::sort(files.begin(), files.end());  // the names hold a random id: directory order varies
  const std::filesystem::path& f = files[(*rng)() % files.size()];
  const auto size = static_cast<std::uintmax_t>(std::filesystem::file_size(f));
  if (size == 0) return;
  const std::uintmax_t at = (*rng)() % size;
  if ((*rng)() % 4 == 0) {
    std::filesystem::resize_file(f, at);
    return;
  }
  std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  io.get(c);
  io.seekp(static_cast<std::streamoff>(at));
  io.put(static_cast<char>(c ^ 0xff));
}

class ReuseRandomizedTest : public ::testing::TestWithParam<Variant> {
 protected:
  // Element of window w's layer for (block, kv, position-in-block): one head, head_dim 1, fp32.
  std::uint32_t* Slot(KVCacheManager& m, std::size_t w, BlockId b, int kv, std::int32_t t) {
    const LayerView v = m.GetLayerView(static_cast<std::int32_t>(w));  // layer i has window i
    auto* base = static_cast<unsigned char*>(v.data);
    return reinterpret_cast<std::uint32_t*>(base + b * v.strides[0] + kv * v.strides[1] + t * v.strides[3]);
  }
  void Write(KVCacheManager& m, SeqId id, const Live& s, std::int32_t p) {
    const auto windows = m.window_sizes();
    for (std::size_t w = 0; w < windows.size(); ++w) {
      const BlockId b = m.GetCacheBlockIds(id, windows[w])[static_cast<std::size_t>(p / kTpb)];
      ASSERT_NE(b, kNullBlock);
      *Slot(m, w, b, 0, p % kTpb) = s.tag[static_cast<std::size_t>(p)];
      *Slot(m, w, b, 1, p % kTpb) = ~s.tag[static_cast<std::size_t>(p)];
    }
  }
};

TEST_P(ReuseRandomizedTest, InvariantsAndBytesHoldAfterEveryOperation) {
  ManagerConfig c = testing::Config({8, 16, 0}, kMaxSeqLen, {{8, 24}, {16, 30}, {64, 60}}, kTpb);
  for (auto& kv : c.blocks_per_window) kv.second.secondary = 8;
  c.enable_block_reuse = true;
  c.swa_reuse_policy = GetParam().policy;
  for (auto& kv : c.blocks_per_window) {
    if (GetParam().disk_blocks > 0) c.disk_blocks_per_window[kv.first] = GetParam().disk_blocks;
  }
  c.max_draft_tokens = 2;
  c.event_buffer_max_size = 1 << 20;  // never drops: the stream must mirror the tree exactly
  const Variant& param = GetParam();
  // The faults variant's tier directory: removed after the manager (declared before it).
  struct TempDir {
    std::string path;
    ~TempDir() {
      if (!path.empty()) std::filesystem::remove_all(path);
    }
  } fault_dir;
  if (param.disk_faults) {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvcache-disk-faults-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    fault_dir.path = pattern;
    c.disk_cache_dir = pattern;
  }
  ModelSpec model = testing::Model(3, {1}, 1);
  model.dtype = DType::kFloat32;
  KVCacheManager m(model, c);
  m.SetFakeTimeMs(0);
  std::mt19937 rng((GetParam().policy == SwaReusePolicy::kInvalidate ? 7u : 8u) +
                   (GetParam().disk_blocks > 0 ? 10u : 0u) + (param.disk_faults ? 20u : 0u));
  std::vector<std::vector<TokenId>> bases(4);
  for (auto& base : bases) {
    for (int i = 0; i < 40; ++i) base.push_back(static_cast<TokenId>(rng() % 6));
  }
  std::map<SeqId, Live> live;
  std::map<WindowSize, std::set<std::uint64_t>> mirror;
  std::map<WindowSize, std::map<std::uint64_t, int>> level;  // cache level of each cached block
  std::int64_t spills = 0;
  std::int64_t disk_onboards = 0;
  SeqId next_id = 0;
  std::int64_t now = 0;
  int failures = 0;
  int failed_after_read_failure = 0;
  int hits = 0;
  int reused_tokens_checked = 0;
  auto pick = [&]() {
    auto it = live.begin();
    std::advance(it, std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
    return it->first;
  };
  auto snapshot = [&]() {
    std::vector<SeqId> ids;
    for (const auto& kv : live) ids.push_back(kv.first);
    auto s = testing::Take(m, ids);
    const KvCacheStats st = m.GetStats();
    return std::make_tuple(s, st.num_cached_nodes, st.reused_blocks, st.offloaded_blocks);
  };
  for (int op = 0; op < param.ops; ++op) {
    if (param.disk_faults && rng() % 8 == 0) InjectDiskFault(fault_dir.path, &rng);
    const auto before = snapshot();
    const std::int64_t read_failures_before = m.GetStats().disk_read_failures;
    const int kind = std::uniform_int_distribution<int>(0, 11)(rng);
    bool threw = false;
    try {
      if (kind <= 2 || live.empty()) {
        Live s;
        const auto& base = bases[rng() % bases.size()];
        const auto keep = std::uniform_int_distribution<std::size_t>(1, base.size())(rng);
        s.tokens.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(keep));
        const auto tail = std::uniform_int_distribution<int>(0, 6)(rng);
        for (int i = 0; i < tail; ++i) s.tokens.push_back(static_cast<TokenId>(rng() % 6));
        if (rng() % 5 == 0) s.lora = 1;
        SequenceOptions opts;
        opts.extras.lora_task_id = s.lora;
        if (rng() % 3 == 0) opts.priority = static_cast<int>(rng() % 101);
        if (rng() % 4 == 0) opts.priority_ranges = {PriorityRange{0, 8, static_cast<int>(rng() % 101), 5}};
        std::uint32_t h = s.lora.has_value() ? 77u : 1u;
        for (const TokenId t : s.tokens) s.tag.push_back(h = Mix(h, static_cast<std::uint32_t>(t)));
        const SeqId id = next_id++;
        const std::int32_t reused = m.AddSequence(id, s.tokens.data(), s.tokens.size(), opts);
        ASSERT_LT(reused, static_cast<std::int32_t>(s.tokens.size()));
        ASSERT_EQ(reused, m.GetRequestStats(id).reused_tokens);
        if (reused > 0) ++hits;
        // Every reused position that a window still holds carries exactly this prefix's KV.
        const auto windows = m.window_sizes();
        for (std::size_t w = 0; w < windows.size(); ++w) {
          const auto blocks = m.GetCacheBlockIds(id, windows[w]);
          for (std::int32_t p = 0; p < reused; ++p) {
            const BlockId b = blocks[static_cast<std::size_t>(p / kTpb)];
            if (windows[w] < kMaxSeqLen && p < reused - windows[w]) continue;
            ASSERT_NE(b, kNullBlock) << "window " << windows[w] << " position " << p;
            ASSERT_EQ(*Slot(m, w, b, 0, p % kTpb), s.tag[static_cast<std::size_t>(p)])
                << "op " << op << " window " << windows[w] << " position " << p;
            ASSERT_EQ(*Slot(m, w, b, 1, p % kTpb), ~s.tag[static_cast<std::size_t>(p)]);
            ++reused_tokens_checked;
          }
        }
        for (std::int32_t p = reused; p < static_cast<std::int32_t>(s.tokens.size()); ++p) Write(m, id, s, p);
        live[id] = std::move(s);
      } else if (kind <= 6) {
        std::vector<SeqId> batch;
        for (const auto& kv : live) {
          if (static_cast<std::int32_t>(kv.second.tokens.size()) < kMaxSeqLen && rng() % 3 != 0) {
            batch.push_back(kv.first);
          }
        }
        std::vector<TokenId> toks;
        for (std::size_t i = 0; i < batch.size(); ++i) toks.push_back(static_cast<TokenId>(rng() % 6));
        m.AddTokens(batch.data(), toks.data(), batch.size());
        for (std::size_t i = 0; i < batch.size(); ++i) {
          Live& s = live[batch[i]];
          s.tokens.push_back(toks[i]);
          s.tag.push_back(Mix(s.tag.back(), static_cast<std::uint32_t>(toks[i])));
          Write(m, batch[i], s, static_cast<std::int32_t>(s.tokens.size()) - 1);
        }
      } else if (kind == 7) {
        const SeqId id = pick();
        Live& s = live[id];
        const auto n = std::uniform_int_distribution<std::int32_t>(
            0, std::min<std::int32_t>(2, static_cast<std::int32_t>(s.tokens.size()) - 1))(rng);
        m.Rewind(id, n);
        s.tokens.resize(s.tokens.size() - static_cast<std::size_t>(n));
        s.tag.resize(s.tokens.size());
      } else if (kind == 8) {
        m.StoreContextBlocks(pick());
      } else if (kind == 9) {
        now += static_cast<std::int64_t>(rng() % 4);
        m.SetFakeTimeMs(now);
        m.RefreshBlocks();
      } else {
        const SeqId id = pick();
        m.RemoveSequence(id, /*store_for_reuse=*/rng() % 8 != 0);
        live.erase(id);
      }
    } catch (const OutOfBlocksError&) {
      threw = true;
    } catch (const std::invalid_argument&) {
      threw = true;  // a rewind into released blocks
    }
    if (threw && m.GetStats().disk_read_failures != read_failures_before) {
      // An admission that found an unreadable block, then lacked blocks for the shorter hit:
      // the block stays dropped and what the undone round moved stays moved (the cache is
      // still true), but no request changed and the new one is not registered.
      ++failures;
      ++failed_after_read_failure;
      ASSERT_TRUE(std::get<0>(snapshot()) == std::get<0>(before)) << "failed op " << op << " changed requests";
      ASSERT_FALSE(m.HasSequence(next_id - 1)) << "op " << op;
    } else if (threw) {
      ++failures;
      ASSERT_TRUE(snapshot() == before) << "failed op " << op << " changed state";
    }
    ASSERT_NO_THROW(m.CheckInvariants()) << "after op " << op;
    // Replaying stored/removed events per window gives exactly the cached blocks.
    for (const KVCacheEvent& e : m.GetLatestEvents(0)) {
      auto& cached = mirror[e.window_size];
      if (e.kind == EventKind::kStored) {
        for (const StoredBlock& b : e.blocks) {
          ASSERT_TRUE(cached.insert(b.hash).second) << "op " << op;
          level[e.window_size][b.hash] = b.cache_level;
        }
      } else if (e.kind == EventKind::kRemoved) {
        for (const std::uint64_t h : e.hashes) {
          ASSERT_EQ(cached.erase(h), 1u) << "op " << op;
          level[e.window_size].erase(h);
        }
      } else if (e.kind == EventKind::kUpdated) {
        ASSERT_EQ(cached.count(e.hash), 1u) << "op " << op;
        if (e.cache_level.has_value()) {
          const auto [from, to] = *e.cache_level;
          ASSERT_EQ(level[e.window_size][e.hash], from) << "op " << op;
          level[e.window_size][e.hash] = to;
          spills += from == 1 && to == 2;
          disk_onboards += from == 2 && to == 0;
        }
      }
    }
    if (op % 50 == 0) {
      for (const WindowSize w : m.window_sizes()) {
        const auto& cached = mirror[w];
        ASSERT_EQ(std::vector<std::uint64_t>(cached.begin(), cached.end()), m.CachedBlockHashes(w)) << "op " << op;
      }
    }
    for (const auto& [id, s] : live) ASSERT_EQ(m.NumTokens(id), static_cast<std::int32_t>(s.tokens.size()));
  }
  EXPECT_GT(failures, 0);
  EXPECT_GT(hits, param.ops / 20);
  EXPECT_GT(reused_tokens_checked, param.ops);
  EXPECT_GT(m.GetStats().offloaded_blocks, 0);
  EXPECT_GT(m.GetStats().onboarded_blocks, 0);
  if (GetParam().disk_blocks > 0) {
    EXPECT_GT(spills, 0);
    EXPECT_GT(disk_onboards, 0);  // and every reused position above held its exact bytes
  } else {
    EXPECT_EQ(spills, 0);
  }
  // Faults are caught on read (never served); without faults, no read ever fails.
  RecordProperty("disk_read_failures", static_cast<int>(m.GetStats().disk_read_failures));
  RecordProperty("disk_onboards", static_cast<int>(disk_onboards));
  RecordProperty("reused_tokens_checked", reused_tokens_checked);
  RecordProperty("failed_after_read_failure", failed_after_read_failure);
  if (param.disk_faults) {
    EXPECT_GT(m.GetStats().disk_read_failures, 10);
  } else {
    EXPECT_EQ(m.GetStats().disk_read_failures, 0);
  }
  for (const auto& kv : live) m.RemoveSequence(kv.first);
  for (const auto& [w, counts] : c.blocks_per_window) EXPECT_EQ(m.GetNumFreeBlocks(w), counts.primary);
  m.CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Policies, ReuseRandomizedTest,
                         ::testing::Values(Variant{SwaReusePolicy::kInvalidate, 0},
                                           Variant{SwaReusePolicy::kPlaceholder, 0},
                                           Variant{SwaReusePolicy::kInvalidate, 12},
                                           Variant{SwaReusePolicy::kPlaceholder, 12},
                                           Variant{SwaReusePolicy::kInvalidate, 12, /*disk_faults=*/true, 4000}),
                         [](const ::testing::TestParamInfo<Variant>& param) {
                           return std::string(param.param.policy == SwaReusePolicy::kInvalidate ? "invalidate"
                                                                                                : "placeholder") +
                                  (param.param.disk_blocks > 0 ? "_disk" : "") +
                                  (param.param.disk_faults ? "_faults" : "");
                         });

}  // namespace
}  // namespace kvcache
