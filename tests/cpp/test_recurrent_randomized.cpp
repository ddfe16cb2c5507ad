// Randomized content test of hybrid models (attention layers + recurrent layers) on the host
// backend: every registered sequence's working state slot must hold exactly the state of its own
// token prefix, never another prefix's, whatever the manager did in between (prefix hits resumed
// from checkpoints, forks, rewinds, evictions of blocks and of checkpoints, offloads of
// checkpoints to host slots, failed calls).
//
// The fake engine plays the recurrent layers: state(prefix) is a rolling 64-bit hash over
// (LoRA id, cache salt, tokens...), advanced token by token, and every state tensor of every
// recurrent layer holds a pattern derived from (that hash, layer, tensor); the empty prefix is the
// all-zero state (what the manager writes into a fresh working slot). For every step (one
// AddSequence, Prefill or AddTokens call, or a Prefill and an AddTokens call of a mixed batch) it:
//   1. checks that every registered sequence's working slot holds state(tokens[0..computed)),
//      where computed is what the previous steps computed, the reused length R right after an
//      AddSequence that hit (the manager copied the checkpoint there; 0 without a hit: zeros),
//      the parent's length right after a fork, the new length right after a successful rewind;
//   2. writes state(tokens[0..num_tokens)) into the working slots of the sequences of the step;
//   3. makes the step's checkpoint copies after that forward pass: half the time through
//      SaveCheckpoints() (the manager copies), half through TakeStateCopies() and its own copies
//      (each copy is checked: it reads the working slot of a sequence of this step whose length is
//      a block boundary, and writes a slot that is no sequence's working slot).
// The state of every registered sequence is also checked after every operation, and right after a
// fork (the children) and a successful rewind (the rewound sequence). A call that fails
// (OutOfBlocksError on admission / prefill / decode, a refused rewind, a full batch) must change
// nothing: block lists, state slots, state counters, and no checkpoint copy queued.
//
// Operations: AddSequence of prompts built from a few shared prefixes (and from earlier finished
// conversations plus a new turn, which resume from their finish checkpoints) with random suffixes,
// LoRA ids and salts (some with a known final length: SetFinalTokens), a first chunk limited by
// GetPromptChunkLimit most of the time (sometimes not, so planned checkpoints are straddled and
// skipped), prefill chunks (GetChunkLimit honoured
// most of the time, several sequences per Prefill call), decode steps (AddTokens over a random
// subset), mixed prefill + decode steps, StoreContextBlocks, RemoveSequence (stored or not), forks
// (and beam steps of the family), rewinds (to checkpoint positions and elsewhere: both succeed and
// fail), drains and ResetPrefixCache (refused while a sequence is registered), RefreshBlocks.
// Attention pools and state pools are tiny, so blocks and checkpoints are evicted constantly; the
// configurations vary windows (full attention, sliding window + full attention, sliding window
// only), tokens per block, state groups (2 and 3, with float32 / float16 / bfloat16 tensors of
// several shapes), host slots for checkpoints, the sliding-window reuse policy and the checkpoint
// policy (prompt_end, finish, junction, chunk_end, interval_blocks, max_per_path).
//
// Knobs (environment variables, as in test_stale_kv):
//   KVCACHE_CONTENT_OPS=N   long mode: the configurations together run at least N operations
//                           (default: 50,000 in total, the CI budget).
//   KVCACHE_CONTENT_SEED=S  added to every configuration's seed (default 0), to explore other runs.
// Every configuration prints its counts and the process prints the totals when it ends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

constexpr std::int64_t kCiOperations = 50000;
constexpr std::int32_t kMaxSeqLen = 48;
constexpr std::uint64_t kVocab = 5;

std::uint64_t Mix64(std::uint64_t h, std::uint64_t v) {
  std::uint64_t x = h * 0x9e3779b97f4a7c15ull + v + 0x632be59bd9b4e019ull;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/// The state "before token 0" of a request: what its extras make of the model (a LoRA adapter
/// changes every state; a salt cannot, but must never hit across either).
std::uint64_t BaseHash(const ReuseExtras& extras) {
  const std::uint64_t lora = extras.lora_task_id ? static_cast<std::uint64_t>(*extras.lora_task_id) + 1 : 0;
  const std::uint64_t salt = extras.cache_salt ? *extras.cache_salt + 1 : 0;
  return Mix64(Mix64(0x5a17e00dull, lora), salt);
}

std::int64_t EnvInt(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoll(v, nullptr, 10);
}

const StateTensorSpec kConv{{4}, DType::kFloat32};      // 16 bytes
const StateTensorSpec kSsm{{2, 3}, DType::kFloat32};    // 24 bytes
const StateTensorSpec kHalf{{5}, DType::kFloat16};      // 10 bytes: not a whole number of words
const StateTensorSpec kBf16{{3, 2}, DType::kBFloat16};  // 12 bytes

/// Two state groups: layers 0 and 2 (two tensors each), layer 1 (one tensor).
std::vector<std::vector<StateTensorSpec>> TwoGroups() { return {{kConv, kSsm}, {kHalf}, {kConv, kSsm}}; }
/// Three state groups: layers 0 and 3, layer 1 (two tensors), layer 2.
std::vector<std::vector<StateTensorSpec>> ThreeGroups() { return {{kConv}, {kSsm, kBf16}, {kHalf}, {kConv}}; }

struct HybridConfig {
  std::string name;
  std::vector<std::int32_t> windows;  // attention layer pattern, one layer each; 0 = full attention
  std::int32_t tpb = 4;
  std::vector<std::vector<StateTensorSpec>> recurrent;
  std::int32_t max_batch = 4;
  std::int32_t state_slots = 7;  // per state group
  std::int32_t host_slots = 0;   // checkpoint host slots per state group
  std::int32_t pool_slack = 0;   // extra primary attention blocks per window
  std::int32_t secondary = 0;    // attention host blocks per window
  std::int32_t max_draft = 0;
  SwaReusePolicy policy = SwaReusePolicy::kPlaceholder;
  CheckpointPolicy cp;
  std::uint64_t seed = 0;  // before KVCACHE_CONTENT_SEED is added

  std::uint64_t EffectiveSeed() const {
    const char* offset = std::getenv("KVCACHE_CONTENT_SEED");
    return seed + (offset == nullptr ? 0 : std::strtoull(offset, nullptr, 10));
  }
};

void PrintTo(const HybridConfig& c, std::ostream* os) { *os << c.name; }

CheckpointPolicy Policy(bool prompt_end, bool finish, bool junction, bool chunk_end, std::int32_t interval,
                        std::int32_t cap) {
  CheckpointPolicy p;
  p.prompt_end = prompt_end;
  p.finish = finish;
  p.junction = junction;
  p.chunk_end = chunk_end;
  p.interval_blocks = interval;
  p.max_per_path = cap;
  return p;
}

std::vector<HybridConfig> HybridConfigs() {
  std::vector<HybridConfig> out;
  auto add = [&](HybridConfig c) {
    c.seed = 0x4ec0000u + out.size() * 7919u;
    out.push_back(std::move(c));
  };
  {
    HybridConfig c;
    c.name = "full_2groups_default";
    c.windows = {0};
    c.recurrent = TwoGroups();
    c.cp = Policy(true, true, true, false, 0, 0);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa8_full_2groups_chunkend_cap2_draft";
    c.windows = {8, 0};
    c.recurrent = TwoGroups();
    c.max_draft = 2;
    c.state_slots = 8;
    c.cp = Policy(true, true, true, true, 0, 2);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa4_full_tpb2_3groups_interval3_invalidate_host";
    c.windows = {4, 0};
    c.tpb = 2;
    c.recurrent = ThreeGroups();
    c.policy = SwaReusePolicy::kInvalidate;
    c.host_slots = 3;
    c.max_draft = 2;
    c.cp = Policy(true, true, false, false, 3, 0);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "full_3groups_promptend_only_tight_host";
    c.windows = {0};
    c.recurrent = ThreeGroups();
    c.state_slots = 5;  // max_batch + 1: one checkpoint at most while the batch is full
    c.host_slots = 4;
    c.cp = Policy(true, false, false, false, 0, 0);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa6_full_full_2groups_finish_junction_interval2_cap3_offload";
    c.windows = {6, 0, 0};
    c.recurrent = TwoGroups();
    c.secondary = 4;
    c.max_draft = 3;
    c.max_batch = 5;
    c.state_slots = 9;
    c.cp = Policy(false, true, true, false, 2, 3);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa5_full_tpb3_2groups_all_policies_host";
    c.windows = {5, 0};
    c.tpb = 3;
    c.recurrent = TwoGroups();
    c.max_batch = 5;
    c.state_slots = 8;
    c.host_slots = 2;
    c.max_draft = 2;
    c.cp = Policy(true, true, true, true, 1, 4);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa8_only_2groups_junction_chunkend";
    c.windows = {8};
    c.recurrent = TwoGroups();
    c.max_draft = 2;
    c.pool_slack = 2;
    c.cp = Policy(true, false, true, true, 0, 0);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa4_only_tpb2_3groups_invalidate_interval2_host";
    c.windows = {4};
    c.tpb = 2;
    c.recurrent = ThreeGroups();
    c.policy = SwaReusePolicy::kInvalidate;
    c.max_draft = 2;
    c.pool_slack = 2;
    c.host_slots = 2;
    c.cp = Policy(true, true, true, false, 2, 0);
    add(c);
  }
  {
    HybridConfig c;
    c.name = "swa4_full_2groups_invalidate_cap1_host";
    c.windows = {4, 0};
    c.recurrent = TwoGroups();
    c.policy = SwaReusePolicy::kInvalidate;
    c.state_slots = 6;
    c.host_slots = 1;
    c.cp = Policy(true, true, true, false, 2, 1);
    add(c);
  }
  return out;
}

std::int64_t OperationsPerConfig() {
  const std::int64_t total = std::max<std::int64_t>(EnvInt("KVCACHE_CONTENT_OPS", kCiOperations), 1);
  const auto configs = static_cast<std::int64_t>(HybridConfigs().size());
  return (total + configs - 1) / configs;
}

struct RunStats {
  std::int64_t operations = 0;
  std::int64_t stale = 0;      // working slots holding another prefix's state
  std::int64_t anomalies = 0;  // stale reads and every other broken expectation
  std::int64_t states_checked = 0;
  std::int64_t adds = 0;
  std::int64_t hits = 0;             // admissions with reused > 0
  std::int64_t resumed_checked = 0;  // ... whose restored working state was verified
  std::int64_t multi_turn_adds = 0;
  std::int64_t final_lengths = 0;  // SetFinalTokens calls
  std::int64_t host_restores = 0;  // hits restored from a host (secondary) checkpoint slot
  std::int64_t chunked_adds = 0;
  std::int64_t chunks = 0;
  std::int64_t chunks_unlimited = 0;  // chunks that ignored the chunk limit
  std::int64_t chunk_batches = 0;
  std::int64_t decode_steps = 0;
  std::int64_t mixed_steps = 0;
  std::int64_t forks = 0;
  std::int64_t fork_children = 0;
  std::int64_t beam_steps = 0;
  std::int64_t rewinds_ok = 0;
  std::int64_t rewinds_refused = 0;
  std::int64_t removes = 0;
  std::int64_t stores = 0;
  std::int64_t drains = 0;
  std::int64_t resets = 0;
  std::int64_t resets_refused = 0;
  std::int64_t out_of_blocks = 0;
  std::int64_t out_of_blocks_admission = 0;
  std::int64_t batch_full = 0;
  std::int64_t saved_copies = 0;  // SaveCheckpoints
  std::int64_t taken_copies = 0;  // TakeStateCopies, copied by the engine
  std::int64_t checkpoints_stored = 0;
  std::int64_t checkpoints_restored = 0;
  std::int64_t checkpoints_skipped = 0;
  std::int64_t checkpoints_evicted = 0;
  std::int64_t checkpoints_offloaded = 0;
  std::int64_t lost_attention = 0;
  std::int64_t lost_sliding = 0;
  std::int64_t lost_checkpoint = 0;
  std::string first_anomaly;
};

struct Totals {
  std::int64_t configs = 0;
  std::int64_t operations = 0;
  std::int64_t stale = 0;
  std::int64_t anomalies = 0;
  std::int64_t hits = 0;
  std::int64_t resumed_checked = 0;
  std::int64_t forks = 0;
  std::int64_t rewinds_ok = 0;
  std::int64_t checkpoints_evicted = 0;
  std::int64_t out_of_blocks = 0;
};
Totals& GlobalTotals() {
  static Totals totals;
  return totals;
}
class TotalsPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    const Totals& t = GlobalTotals();
    if (t.configs == 0) return;
    std::printf("[recurrent] total: %" PRId64 " configurations, %" PRId64 " operations, %" PRId64 " stale reads, %" PRId64
                " anomalies, %" PRId64 " hits (%" PRId64 " resumed states checked), %" PRId64 " forks, %" PRId64
                " successful rewinds, %" PRId64 " checkpoints evicted, %" PRId64 " out-of-blocks\n",
                t.configs, t.operations, t.stale, t.anomalies, t.hits, t.resumed_checked, t.forks, t.rewinds_ok,
                t.checkpoints_evicted, t.out_of_blocks);
  }
};
[[maybe_unused]] ::testing::Environment* const kTotalsPrinter = ::testing::AddGlobalTestEnvironment(new TotalsPrinter);

/// A failed call must change nothing of this.
struct Snapshot {
  testing::Snapshot blocks;
  std::map<SeqId, std::vector<SlotId>> slots;
  std::vector<std::int64_t> counters;
  bool operator==(const Snapshot& o) const { return blocks == o.blocks && slots == o.slots && counters == o.counters; }
};

class HybridRun {
 public:
  HybridRun(const HybridConfig& config, std::int64_t operations)
      : config_(config), operations_(operations), rng_(config.EffectiveSeed()), m_(Model(config), Manager(config)) {
    const std::vector<StateGroupInfo> groups = m_.state_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      Group group;
      group.layers = groups[g].layers;
      group.tensors = groups[g].tensors;
      group.slot_bytes = groups[g].slot_bytes;
      group.num_slots = groups[g].num_slots;
      group.ptr = reinterpret_cast<unsigned char*>(groups[g].ptr);
      for (const std::int32_t layer : group.layers) {
        std::vector<StateView> views;
        for (std::size_t t = 0; t < group.tensors.size(); ++t) {
          const StateView v = m_.GetStateView(layer, static_cast<std::int32_t>(t));
          // [slots, *shape], C-contiguous inside a slot, one slot every slot_bytes.
          std::int64_t stride = DTypeBytes(v.dtype);
          for (std::size_t d = v.shape.size(); d-- > 1;) {
            if (v.strides[d] != stride) Anomaly("state view of layer " + std::to_string(layer) + " is not contiguous");
            stride *= v.shape[d];
          }
          if (v.strides[0] != static_cast<std::int64_t>(group.slot_bytes) || v.shape[0] != group.num_slots) {
            Anomaly("state view of layer " + std::to_string(layer) + " does not step by slots");
          }
          views.push_back(v);
        }
        group.views.push_back(std::move(views));
      }
      groups_.push_back(std::move(group));
    }
    for (int b = 0; b < 3; ++b) {
      std::vector<TokenId> base;
      for (std::int32_t i = 0; i < kMaxSeqLen; ++i) base.push_back(RandomToken());
      bases_.push_back(std::move(base));
    }
  }

  RunStats Run() {
    if (groups_.size() < 2) Anomaly("the model should have at least 2 state groups");
    for (op_ = 0; op_ < operations_ && stats_.first_anomaly.empty(); ++op_) {
      try {
        Operation();
        for (auto& [id, r] : live_) CheckWorking(id, r, r.computed, "after the operation");
        if (op_ % 8 == 0) CheckManager();
      } catch (const std::exception& e) {
        Anomaly(std::string("unexpected exception: ") + e.what());
      }
      ++stats_.operations;
    }
    if (stats_.first_anomaly.empty()) {
      try {
        while (!live_.empty()) Remove(live_.begin()->first, true);
        CheckManager();
        const KvCacheStats s = m_.GetStats();
        if (s.working_state_slots != 0 || s.pending_checkpoints != 0) Anomaly("state slots held after the drain");
      } catch (const std::exception& e) {
        Anomaly(std::string("unexpected exception in the drain: ") + e.what());
      }
    }
    const KvCacheStats s = m_.GetStats();
    stats_.checkpoints_stored = s.checkpoints_stored;
    stats_.checkpoints_restored = s.checkpoints_restored;
    stats_.checkpoints_skipped = s.checkpoints_skipped;
    stats_.checkpoints_evicted = s.checkpoints_evicted;
    stats_.checkpoints_offloaded = s.checkpoints_offloaded;
    stats_.host_restores = s.checkpoints_onboarded;
    stats_.lost_attention = s.lost_hit_tokens_attention;
    stats_.lost_sliding = s.lost_hit_tokens_sliding_window;
    stats_.lost_checkpoint = s.lost_hit_tokens_no_checkpoint;
    return stats_;
  }

 private:
  struct Group {
    std::vector<std::int32_t> layers;
    std::vector<StateTensorSpec> tensors;
    std::vector<std::vector<StateView>> views;  // per layer of the group, per tensor
    std::size_t slot_bytes = 0;
    std::int32_t num_slots = 0;
    unsigned char* ptr = nullptr;
  };
  struct Req {
    std::vector<TokenId> tokens;   // the prompt, then the generated tokens (size >= num)
    std::vector<std::uint64_t> h;  // h[i]: state hash after tokens[0..i) (h[0]: the base)
    std::int32_t prompt_len = 0;
    std::int32_t num = 0;       // tokens with blocks (NumTokens)
    std::int32_t computed = 0;  // tokens whose state the working slots hold
    std::int32_t final_tokens = kMaxSeqLen;  // decoding stops there (SetFinalTokens, or max_seq_len)
    bool hit_unchecked = false;  // admitted with a hit: the first check verifies the restore
    bool InPrefill() const { return num < prompt_len; }
    void Push(TokenId t) {
      tokens.resize(static_cast<std::size_t>(num));
      h.resize(static_cast<std::size_t>(num) + 1);
      tokens.push_back(t);
      h.push_back(Mix64(h.back(), static_cast<std::uint64_t>(t)));
      ++num;
    }
  };

  static ModelSpec Model(const HybridConfig& c) {
    ModelSpec m = testing::Model(static_cast<std::int32_t>(c.windows.size()), {1}, 2);
    m.recurrent_layers = c.recurrent;
    return m;
  }

  static ManagerConfig Manager(const HybridConfig& c) {
    const std::int32_t blocks_per_seq = (kMaxSeqLen + c.tpb - 1) / c.tpb;
    std::map<WindowSize, std::int32_t> primary;
    for (const std::int32_t w : c.windows) {
      const bool full = w <= 0 || w >= kMaxSeqLen;
      // About two longest sequences in full attention; a sliding window gives blocks back while
      // decoding and prefilling in chunks, so about one and a half.
      primary[full ? kMaxSeqLen : w] = (full ? 2 * blocks_per_seq + 2 : blocks_per_seq * 3 / 2) + c.pool_slack;
    }
    ManagerConfig m = testing::Config(c.windows, kMaxSeqLen, primary, c.tpb);
    for (auto& kv : m.blocks_per_window) kv.second.secondary = c.secondary;
    m.enable_block_reuse = true;
    m.max_batch_size = c.max_batch;
    m.state_slots = c.state_slots;
    m.state_secondary_slots = c.host_slots;
    m.checkpoint_policy = c.cp;
    m.max_draft_tokens = c.max_draft;
    m.swa_reuse_policy = c.policy;
    return m;
  }

  // ---- Randomness.
  std::uint64_t Rand(std::uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Chance(int percent) { return Rand(100) < static_cast<std::uint64_t>(percent); }
  TokenId RandomToken() { return static_cast<TokenId>(Rand(kVocab)); }
  /// Greedy decoding: the same prefix mostly continues the same way.
  TokenId NextToken(const Req& r) {
    if (Chance(25)) return RandomToken();
    return static_cast<TokenId>((r.h[static_cast<std::size_t>(r.num)] >> 33) % kVocab);
  }
  template <typename Pred>
  std::vector<SeqId> LiveWhere(Pred pred) const {
    std::vector<SeqId> ids;
    for (const auto& [id, r] : live_) {
      if (pred(r)) ids.push_back(id);
    }
    return ids;
  }
  SeqId Pick(const std::vector<SeqId>& ids) { return ids[Rand(ids.size())]; }

  // ---- Anomalies.
  std::string Context() const {
    std::ostringstream os;
    os << config_.name << " seed " << config_.EffectiveSeed() << " op " << op_;
    return os.str();
  }
  void Log(const std::string& s) {
    log_.push_back(std::to_string(op_) + ": " + s);
    if (log_.size() > 40) log_.pop_front();
  }
  void Anomaly(const std::string& what) {
    ++stats_.anomalies;
    if (stats_.first_anomaly.empty()) {
      std::ostringstream os;
      os << Context() << ": " << what << "\n  recent operations:\n";
      for (const std::string& l : log_) os << "    " << l << "\n";
      stats_.first_anomaly = os.str();
    }
  }

  // ---- State bytes.
  static void Encode(std::int32_t layer, std::size_t tensor, std::int32_t n, std::uint64_t h, unsigned char* out,
                     std::size_t bytes) {
    if (n == 0) {
      std::memset(out, 0, bytes);
      return;
    }
    for (std::size_t i = 0; i < bytes; i += 8) {
      const std::uint64_t w = Mix64(h, static_cast<std::uint64_t>(layer) * 1024u + tensor * 64u + i / 8);
      std::memcpy(out + i, &w, std::min<std::size_t>(8, bytes - i));
    }
  }
  unsigned char* TensorAt(const Group& g, std::size_t li, std::size_t t, SlotId s) const {
    const StateView& v = g.views[li][t];
    return static_cast<unsigned char*>(v.data) + static_cast<std::int64_t>(s) * v.strides[0];
  }
  bool SlotHolds(const Group& g, SlotId s, std::int32_t n, std::uint64_t h) const {
    unsigned char buf[64];
    for (std::size_t li = 0; li < g.layers.size(); ++li) {
      for (std::size_t t = 0; t < g.tensors.size(); ++t) {
        const std::size_t bytes = g.tensors[t].Bytes();
        Encode(g.layers[li], t, n, h, buf, bytes);
        if (std::memcmp(buf, TensorAt(g, li, t, s), bytes) != 0) return false;
      }
    }
    return true;
  }
  void WriteSlot(const Group& g, SlotId s, std::int32_t n, std::uint64_t h) {
    for (std::size_t li = 0; li < g.layers.size(); ++li) {
      for (std::size_t t = 0; t < g.tensors.size(); ++t) {
        Encode(g.layers[li], t, n, h, TensorAt(g, li, t, s), g.tensors[t].Bytes());
      }
    }
  }
  /// Every state group's working slot of `id` holds state(tokens[0..n)).
  void CheckWorking(SeqId id, Req& r, std::int32_t n, const char* when) {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const SlotId s = m_.GetStateSlot(id, static_cast<std::int32_t>(g));
      ++stats_.states_checked;
      if (s < 0 || s >= groups_[g].num_slots) {
        Anomaly("request " + std::to_string(id) + " has working slot " + std::to_string(s) + " in group " +
                std::to_string(g));
        return;
      }
      if (SlotHolds(groups_[g], s, n, r.h[static_cast<std::size_t>(n)])) continue;
      ++stats_.stale;
      std::ostringstream os;
      os << "stale state " << when << ": request " << id << " group " << g << " slot " << s << " should hold its "
         << n << "-token prefix (num_tokens " << r.num << ", prompt " << r.prompt_len << ") but holds ";
      std::int32_t own = -1;
      for (std::size_t j = 0; j < r.h.size(); ++j) {
        if (SlotHolds(groups_[g], s, static_cast<std::int32_t>(j), r.h[j])) own = static_cast<std::int32_t>(j);
      }
      if (own >= 0) {
        os << "the state of its own " << own << "-token prefix";
      } else {
        os << "no state of its own prefixes (another prefix's, or garbage)";
      }
      Anomaly(os.str());
      return;
    }
    if (r.hit_unchecked) {
      r.hit_unchecked = false;
      ++stats_.resumed_checked;
    }
  }

  Snapshot Snap() const {
    Snapshot s;
    for (const WindowSize w : m_.window_sizes()) s.blocks.free.push_back(m_.GetNumFreeBlocks(w));
    for (const auto& [id, r] : live_) {
      s.blocks.tokens[id] = m_.NumTokens(id);
      auto& lists = s.blocks.blocks[id];
      for (const WindowSize w : m_.window_sizes()) lists.push_back(m_.GetCacheBlockIds(id, w));
      auto& slots = s.slots[id];
      for (std::size_t g = 0; g < groups_.size(); ++g) slots.push_back(m_.GetStateSlot(id, static_cast<std::int32_t>(g)));
    }
    const KvCacheStats st = m_.GetStats();
    s.counters = {st.working_state_slots,   st.pending_checkpoints,    st.cached_checkpoints,
                  st.free_state_slots,      st.host_cached_checkpoints, st.checkpoints_stored,
                  st.checkpoints_restored,  st.checkpoints_skipped,     st.checkpoints_evicted,
                  st.checkpoints_offloaded, st.checkpoints_onboarded,   st.num_cached_nodes,
                  st.lost_hit_tokens_attention, st.lost_hit_tokens_sliding_window, st.lost_hit_tokens_no_checkpoint,
                  st.reused_blocks,         st.missed_blocks};
    s.blocks.alloc_total = st.alloc_total_blocks;
    return s;
  }
  /// After a failed call: nothing changed, no copy is queued, every state is intact.
  void CheckUnchanged(const Snapshot& before, const std::string& what) {
    if (!(Snap() == before)) Anomaly("failed " + what + " changed the manager's state");
    std::vector<StateCopy> queued;
    m_.TakeStateCopies(&queued);
    if (!queued.empty()) Anomaly("failed " + what + " left " + std::to_string(queued.size()) + " state copies queued");
    for (auto& [id, r] : live_) CheckWorking(id, r, r.computed, "after a failed call");
  }

  void CheckManager() {
    try {
      m_.CheckInvariants();
    } catch (const std::exception& e) {
      Anomaly(std::string("CheckInvariants: ") + e.what());
      return;
    }
    const KvCacheStats s = m_.GetStats();
    const auto groups = static_cast<std::int64_t>(groups_.size());
    if (s.working_state_slots != static_cast<std::int64_t>(live_.size()) * groups) {
      Anomaly("working_state_slots " + std::to_string(s.working_state_slots) + " for " + std::to_string(live_.size()) +
              " sequences");
    }
    if (s.state_slots != groups * config_.state_slots ||
        s.working_state_slots + s.pending_checkpoints + s.cached_checkpoints + s.free_state_slots != s.state_slots) {
      Anomaly("state slot counts do not add up");
    }
    for (const auto& [id, r] : live_) {
      if (m_.NumTokens(id) != r.num) Anomaly("request " + std::to_string(id) + " has a different length");
    }
  }

  // ---- Steps.
  /// The forward pass of a step over `stepped`, then the checkpoint copies it queued.
  void Forward(const std::vector<SeqId>& stepped) {
    for (auto& [id, r] : live_) CheckWorking(id, r, r.computed, "before the forward pass");
    std::map<std::int32_t, std::set<SlotId>> sources;  // per group: slots a checkpoint may copy
    for (const SeqId id : stepped) {
      Req& r = live_.at(id);
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        const SlotId s = m_.GetStateSlot(id, static_cast<std::int32_t>(g));
        WriteSlot(groups_[g], s, r.num, r.h[static_cast<std::size_t>(r.num)]);
        if (r.num % config_.tpb == 0) sources[static_cast<std::int32_t>(g)].insert(s);
      }
      r.computed = r.num;
    }
    if (Chance(50)) {
      stats_.saved_copies += m_.SaveCheckpoints();
      return;
    }
    std::vector<StateCopy> after;
    m_.TakeStateCopies(&after);
    std::map<std::int32_t, std::set<SlotId>> working;
    for (const auto& [id, r] : live_) {
      for (std::size_t g = 0; g < groups_.size(); ++g) {
        working[static_cast<std::int32_t>(g)].insert(m_.GetStateSlot(id, static_cast<std::int32_t>(g)));
      }
    }
    std::map<std::int32_t, std::set<SlotId>> written;
    for (const StateCopy& c : after) {
      if (c.group < 0 || static_cast<std::size_t>(c.group) >= groups_.size()) {
        Anomaly("a state copy of group " + std::to_string(c.group));
        return;
      }
      const Group& g = groups_[static_cast<std::size_t>(c.group)];
      std::ostringstream os;
      os << "state copy group " << c.group << " " << c.src << " -> " << c.dst << ": ";
      if (c.src == kNoSlot || sources[c.group].count(c.src) == 0) {
        Anomaly(os.str() + "the source is no working slot of a sequence of this step at a block boundary");
        return;
      }
      if (c.dst < 0 || c.dst >= g.num_slots || working[c.group].count(c.dst) != 0 || !written[c.group].insert(c.dst).second) {
        Anomaly(os.str() + "the destination is a working slot, a host slot or written twice");
        return;
      }
      std::memcpy(g.ptr + static_cast<std::size_t>(c.dst) * g.slot_bytes, g.ptr + static_cast<std::size_t>(c.src) * g.slot_bytes,
                  g.slot_bytes);
      ++stats_.taken_copies;
    }
  }

  /// A step ran short of blocks: the engine preempts a request.
  void Preempt() {
    if (live_.empty()) return;
    const SeqId id = Pick(LiveWhere([](const Req&) { return true; }));
    Remove(id, Chance(50));
  }

  void Remove(SeqId id, bool store) {
    Log("remove " + std::to_string(id) + (store ? " stored" : " not stored"));
    m_.RemoveSequence(id, store);
    Req& r = live_.at(id);
    if (store && !r.InPrefill() && r.num > 1) {
      std::vector<TokenId> done(r.tokens.begin(), r.tokens.begin() + r.num);
      if (history_.size() < 12) {
        history_.push_back({std::move(done), extras_.at(id)});
      } else {
        history_[Rand(history_.size())] = {std::move(done), extras_.at(id)};
      }
    }
    live_.erase(id);
    extras_.erase(id);
    ++stats_.removes;
  }

  void Operation() {
    const std::uint64_t dice = Rand(100);
    if (live_.empty() || dice < 17) return Add();
    if (dice < 30) return PrefillSome();
    if (dice < 48) return Decode();
    if (dice < 52) return MixedStep();
    if (dice < 58) return ForkSome();
    if (dice < 68) return RewindSome();
    if (dice < 73) return StoreSome();
    if (dice < 86) return Remove(Pick(LiveWhere([](const Req&) { return true; })), Chance(85));
    if (dice < 87) return Drain();
    if (dice < 88) return ResetWhileBusy();
    if (dice < 90) {
      m_.RefreshBlocks();
      return;
    }
    return Decode();
  }

  /// An admission; its forward pass runs now, or with the rest of the step when `step` is given.
  void Add(std::vector<SeqId>* step = nullptr) {
    if (static_cast<std::int32_t>(live_.size()) >= config_.max_batch) {
      if (step != nullptr) return;
      if (Chance(30)) {
        // A full batch refuses the admission, changing nothing.
        const std::vector<TokenId> t = {1, 2, 3};
        const Snapshot before = Snap();
        try {
          m_.AddSequence(next_id_, t.data(), t.size());
          Anomaly("an admission past max_batch_size was accepted");
        } catch (const KVCacheError&) {
          ++stats_.batch_full;
          CheckUnchanged(before, "admission past max_batch_size");
        }
        return;
      }
      Preempt();
    }
    // The prompt: a shared prefix (or an earlier conversation) and a random suffix.
    std::vector<TokenId> tokens;
    ReuseExtras extras;
    bool multi_turn = false;
    if (!history_.empty() && Chance(30)) {
      const auto& [done, ex] = history_[Rand(history_.size())];
      tokens = done;
      extras = ex;
      multi_turn = true;
      const auto tail = 1 + Rand(6);
      for (std::uint64_t i = 0; i < tail; ++i) tokens.push_back(RandomToken());
    } else {
      const auto& base = bases_[Rand(bases_.size())];
      // Mostly a few fixed prefix lengths, so that identical prefixes recur.
      static constexpr std::size_t kKeeps[] = {6, 9, 13, 17, 21, 26, 31, 36};
      const std::size_t keep = Chance(70) ? kKeeps[Rand(8)] : static_cast<std::size_t>(1 + Rand(36));
      tokens.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(keep));
      const auto tail = Rand(7);
      for (std::uint64_t i = 0; i < tail; ++i) tokens.push_back(RandomToken());
      if (Chance(8)) extras.lora_task_id = static_cast<std::int64_t>(Rand(2));
      if (Chance(5)) extras.cache_salt = 7;
    }
    if (tokens.size() > static_cast<std::size_t>(kMaxSeqLen - 2)) tokens.resize(static_cast<std::size_t>(kMaxSeqLen - 2));
    const auto n = static_cast<std::int32_t>(tokens.size());
    const PreparedPrompt prepared = m_.Prepare(tokens.data(), tokens.size(), extras);
    const ReusableByKind by_kind = m_.GetReusableByKind(prepared);
    const std::int32_t predicted = by_kind.reused;
    if (predicted != m_.GetReusablePrefixLength(prepared) || predicted % config_.tpb != 0 || predicted >= n ||
        by_kind.recurrent_state != predicted || by_kind.sliding_window > by_kind.full_attention ||
        by_kind.full_attention > by_kind.matched || by_kind.recurrent_state > by_kind.sliding_window) {
      std::ostringstream os;
      os << "reusable by kind: matched " << by_kind.matched << " full " << by_kind.full_attention << " sliding "
         << by_kind.sliding_window << " state " << by_kind.recurrent_state << " reused " << predicted
         << " prefix length " << m_.GetReusablePrefixLength(prepared) << " for " << n << " tokens";
      Anomaly(os.str());
      return;
    }
    std::optional<std::int32_t> prefill;
    bool limited = false;
    if (Chance(75)) {
      const std::int32_t rest = n - predicted;
      std::int32_t chunk = Chance(30) ? rest : 1 + static_cast<std::int32_t>(Rand(static_cast<std::uint64_t>(std::min(rest, 16))));
      if (Chance(75)) {
        const std::int32_t limit = m_.GetPromptChunkLimit(prepared, chunk);
        if (limit < 1 || limit > chunk) {
          Anomaly("get_prompt_chunk_limit " + std::to_string(limit) + " for " + std::to_string(chunk));
          return;
        }
        chunk = limit;
        limited = true;
      }
      prefill = chunk;
    }
    SequenceOptions options;
    if (Chance(20)) options.priority = static_cast<int>(Rand(101));
    const SeqId id = next_id_++;
    {
      std::ostringstream os;
      os << "add " << id << " n " << n << " predicted " << predicted << " prefill "
         << (prefill ? std::to_string(*prefill) : std::string("all")) << (limited ? " (limited)" : "")
         << (multi_turn ? " multi-turn" : "");
      Log(os.str());
    }
    const Snapshot before = Snap();
    const std::int64_t restored_before = m_.GetStats().checkpoints_restored;
    std::int32_t reused = 0;
    try {
      if (Chance(50)) {
        reused = m_.AddSequence(id, prepared, options, prefill);
      } else {
        options.extras = extras;
        reused = m_.AddSequence(id, tokens.data(), tokens.size(), options, prefill);
      }
    } catch (const OutOfBlocksError&) {
      ++stats_.out_of_blocks;
      ++stats_.out_of_blocks_admission;
      if (step == nullptr || step->empty()) CheckUnchanged(before, "admission");
      if (m_.HasSequence(id)) Anomaly("a failed admission registered its request");
      return;
    }
    ++stats_.adds;
    if (prefill) ++stats_.chunked_adds;
    if (multi_turn) ++stats_.multi_turn_adds;
    if (reused != predicted) {
      Anomaly("add_sequence reused " + std::to_string(reused) + ", get_reusable_by_kind said " + std::to_string(predicted));
      return;
    }
    const std::int64_t restored = m_.GetStats().checkpoints_restored - restored_before;
    if (restored != (reused > 0 ? 1 : 0)) {
      Anomaly("a hit of " + std::to_string(reused) + " tokens counted " + std::to_string(restored) + " restores");
    }
    Req r;
    r.tokens = tokens;
    r.h.push_back(BaseHash(extras));
    for (const TokenId t : tokens) r.h.push_back(Mix64(r.h.back(), static_cast<std::uint64_t>(t)));
    r.prompt_len = n;
    r.num = prefill ? std::min(n, reused + *prefill) : n;
    r.computed = reused;
    r.hit_unchecked = reused > 0;
    if (reused > 0) ++stats_.hits;
    if (Chance(40)) {
      // The final length is known: the finish checkpoint at its last boundary may evict.
      r.final_tokens = std::min(kMaxSeqLen, n + 1 + static_cast<std::int32_t>(Rand(16)));
      m_.SetFinalTokens(id, r.final_tokens);
      ++stats_.final_lengths;
    }
    live_.emplace(id, std::move(r));
    extras_.emplace(id, extras);
    // The manager restored the checkpoint (or zeroed the slot) already: checked now, before the
    // rest of the step (which may preempt this request) and again before the forward pass.
    CheckWorking(id, live_.at(id), reused, "after the admission");
    if (step != nullptr) {
      step->push_back(id);
    } else {
      Forward({id});
    }
  }

  /// Prefill chunks of 1..3 sequences in prefill, in one Prefill call; false if none ran.
  bool PrefillCall(std::vector<SeqId>* stepped) {
    // A sequence computes one chunk per step: none already in this step.
    std::vector<SeqId> ids;
    for (const SeqId id : LiveWhere([](const Req& r) { return r.InPrefill(); })) {
      if (std::find(stepped->begin(), stepped->end(), id) == stepped->end()) ids.push_back(id);
    }
    if (ids.empty()) return false;
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(std::min<std::size_t>(ids.size(), 1 + Rand(3)));
    std::vector<std::int32_t> chunks;
    std::ostringstream os;
    os << "prefill";
    for (const SeqId id : ids) {
      const Req& r = live_.at(id);
      const std::int32_t rest = r.prompt_len - r.num;
      std::int32_t chunk = Chance(30) ? rest : 1 + static_cast<std::int32_t>(Rand(static_cast<std::uint64_t>(std::min(rest, 12))));
      if (Chance(80)) {
        const std::int32_t limit = m_.GetChunkLimit(id, chunk);
        if (limit < 1 || limit > chunk) {
          Anomaly("get_chunk_limit " + std::to_string(limit) + " for " + std::to_string(chunk));
          return false;
        }
        chunk = limit;
      } else {
        ++stats_.chunks_unlimited;
      }
      chunks.push_back(chunk);
      os << " " << id << ":" << r.num << "+" << chunk;
    }
    Log(os.str());
    const Snapshot before = Snap();
    try {
      if (ids.size() == 1 && Chance(50)) {
        m_.Prefill(ids[0], chunks[0]);
      } else {
        m_.Prefill(ids.data(), chunks.data(), ids.size());
      }
    } catch (const OutOfBlocksError&) {
      ++stats_.out_of_blocks;
      if (stepped->empty()) CheckUnchanged(before, "prefill");
      Preempt();
      return false;
    }
    for (std::size_t i = 0; i < ids.size(); ++i) live_.at(ids[i]).num += chunks[i];
    stats_.chunks += static_cast<std::int64_t>(ids.size());
    if (ids.size() > 1) ++stats_.chunk_batches;
    stepped->insert(stepped->end(), ids.begin(), ids.end());
    return true;
  }

  /// One decode token for each of `ids` in one AddTokens call; false if it failed.
  bool DecodeCall(const std::vector<SeqId>& ids, std::vector<SeqId>* stepped) {
    if (ids.empty()) return false;
    std::vector<TokenId> tokens;
    std::ostringstream os;
    os << "decode";
    for (const SeqId id : ids) {
      tokens.push_back(NextToken(live_.at(id)));
      os << " " << id << ":" << live_.at(id).num;
    }
    Log(os.str());
    const Snapshot before = Snap();
    try {
      if (ids.size() == 1 && Chance(50)) {
        m_.AddToken(ids[0], tokens[0]);
      } else {
        m_.AddTokens(ids.data(), tokens.data(), ids.size());
      }
    } catch (const OutOfBlocksError&) {
      ++stats_.out_of_blocks;
      if (stepped->empty()) CheckUnchanged(before, "decode");
      Preempt();
      return false;
    }
    for (std::size_t i = 0; i < ids.size(); ++i) live_.at(ids[i]).Push(tokens[i]);
    stepped->insert(stepped->end(), ids.begin(), ids.end());
    return true;
  }

  std::vector<SeqId> DecodingSubset() {
    std::vector<SeqId> ids;
    for (const SeqId id : LiveWhere([](const Req& r) { return !r.InPrefill() && r.num < r.final_tokens; })) {
      if (Chance(70)) ids.push_back(id);
    }
    return ids;
  }

  void PrefillSome() {
    std::vector<SeqId> stepped;
    if (PrefillCall(&stepped)) Forward(stepped);
  }

  void Decode() {
    std::vector<SeqId> stepped;
    if (DecodeCall(DecodingSubset(), &stepped)) {
      ++stats_.decode_steps;
      Forward(stepped);
    }
  }

  /// A step of a mixed batch: prefill chunks, decode tokens and sometimes a new request (admitted
  /// first or last), one forward pass over all of them.
  void MixedStep() {
    std::vector<SeqId> stepped;
    const bool admit = Chance(50);
    const bool admit_first = Chance(50);
    if (admit && admit_first) Add(&stepped);
    const std::vector<SeqId> decoding = DecodingSubset();
    PrefillCall(&stepped);
    std::vector<SeqId> decode;
    for (const SeqId id : decoding) {
      // A failed prefill may have preempted it; an admission of this step is not decoded too.
      if (live_.count(id) != 0 && std::find(stepped.begin(), stepped.end(), id) == stepped.end()) decode.push_back(id);
    }
    DecodeCall(decode, &stepped);
    if (admit && !admit_first) Add(&stepped);
    if (stepped.empty()) return;
    // A preemption after the first call may have removed a sequence of the step.
    std::vector<SeqId> alive;
    for (const SeqId id : stepped) {
      if (live_.count(id) != 0) alive.push_back(id);
    }
    ++stats_.mixed_steps;
    Forward(alive);
  }

  void ForkSome() {
    const SeqId parent = Pick(LiveWhere([](const Req&) { return true; }));
    const std::int32_t room = config_.max_batch - static_cast<std::int32_t>(live_.size());
    std::vector<SeqId> kids;
    const auto want = static_cast<std::int32_t>(1 + Rand(2));
    for (std::int32_t i = 0; i < std::min(want, room); ++i) kids.push_back(next_id_++);
    if (kids.empty()) {
      if (!Chance(30)) return;
      kids.push_back(next_id_++);  // past max_batch_size: refused, nothing changed
      const Snapshot before = Snap();
      try {
        m_.ForkSequence(parent, kids.data(), kids.size());
        Anomaly("a fork past max_batch_size was accepted");
      } catch (const KVCacheError&) {
        ++stats_.batch_full;
        CheckUnchanged(before, "fork past max_batch_size");
      }
      return;
    }
    Log("fork " + std::to_string(parent) + " into " + std::to_string(kids.size()));
    m_.ForkSequence(parent, kids.data(), kids.size());
    ++stats_.forks;
    stats_.fork_children += static_cast<std::int64_t>(kids.size());
    const Req& p = live_.at(parent);
    for (const SeqId k : kids) {
      Req child = p;
      child.hit_unchecked = false;
      live_.emplace(k, child);
      extras_.emplace(k, extras_.at(parent));
    }
    for (const SeqId k : kids) CheckWorking(k, live_.at(k), live_.at(k).computed, "after the fork");
    if (!p.InPrefill() && p.num < p.final_tokens && Chance(60)) {
      // The family steps together, each with its own token.
      std::vector<SeqId> family = kids;
      family.push_back(parent);
      std::vector<SeqId> stepped;
      if (DecodeCall(family, &stepped)) {
        std::vector<SeqId> alive;
        for (const SeqId id : stepped) {
          if (live_.count(id) != 0) alive.push_back(id);
        }
        ++stats_.beam_steps;
        Forward(alive);
      }
    }
  }

  void RewindSome() {
    const std::vector<SeqId> ids = LiveWhere([](const Req& r) { return !r.InPrefill() && r.num >= 2; });
    if (ids.empty()) return;
    const SeqId id = Pick(ids);
    Req& r = live_.at(id);
    const std::int32_t tpb = config_.tpb;
    std::int32_t target = 0;
    const std::uint64_t how = Rand(10);
    if (how < 5) {
      target = (r.num - 1) / tpb * tpb;  // the last boundary before the end: a finish checkpoint
    } else if (how < 8) {
      target = static_cast<std::int32_t>(Rand(static_cast<std::uint64_t>((r.num - 1) / tpb + 1))) * tpb;
    } else {
      target = r.num - static_cast<std::int32_t>(Rand(static_cast<std::uint64_t>(std::min(r.num, 4))));
    }
    if (target <= 0 || target > r.num) target = r.num - 1;
    const std::int32_t k = r.num - target;
    Log("rewind " + std::to_string(id) + " from " + std::to_string(r.num) + " by " + std::to_string(k));
    const Snapshot before = Snap();
    try {
      m_.Rewind(id, k);
    } catch (const std::invalid_argument&) {
      ++stats_.rewinds_refused;
      CheckUnchanged(before, "rewind");
      return;
    } catch (const OutOfBlocksError&) {
      ++stats_.out_of_blocks;
      CheckUnchanged(before, "rewind");
      return;
    }
    ++stats_.rewinds_ok;
    r.num = target;
    r.tokens.resize(static_cast<std::size_t>(target));
    r.h.resize(static_cast<std::size_t>(target) + 1);
    r.prompt_len = std::min(r.prompt_len, target);
    r.computed = target;
    CheckWorking(id, r, target, "after the rewind");
  }

  void StoreSome() {
    std::vector<SeqId> ids = LiveWhere([](const Req&) { return true; });
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(std::min<std::size_t>(ids.size(), 1 + Rand(2)));
    Log("store_context_blocks " + std::to_string(ids[0]) + (ids.size() > 1 ? " and another" : ""));
    if (ids.size() == 1) {
      m_.StoreContextBlocks(ids[0]);
    } else {
      m_.StoreContextBlocks(ids.data(), ids.size());
    }
    ++stats_.stores;
  }

  void Drain() {
    Log("drain");
    while (!live_.empty()) Remove(live_.begin()->first, Chance(80));
    ++stats_.drains;
    if (!Chance(40)) return;
    if (!m_.ResetPrefixCache()) {
      Anomaly("reset_prefix_cache refused with no sequence registered");
      return;
    }
    ++stats_.resets;
    const KvCacheStats s = m_.GetStats();
    if (s.cached_checkpoints != 0 || s.host_cached_checkpoints != 0 || s.num_cached_nodes != 0 ||
        s.free_state_slots != s.state_slots) {
      Anomaly("reset_prefix_cache left cached checkpoints or nodes");
    }
  }

  void ResetWhileBusy() {
    const Snapshot before = Snap();
    if (m_.ResetPrefixCache()) {
      Anomaly("reset_prefix_cache accepted with sequences registered");
      return;
    }
    ++stats_.resets_refused;
    CheckUnchanged(before, "reset_prefix_cache");
  }

  HybridConfig config_;
  std::int64_t operations_;
  std::mt19937_64 rng_;
  KVCacheManager m_;
  std::vector<Group> groups_;
  std::vector<std::vector<TokenId>> bases_;
  std::vector<std::pair<std::vector<TokenId>, ReuseExtras>> history_;  // finished conversations
  std::map<SeqId, Req> live_;
  std::map<SeqId, ReuseExtras> extras_;
  std::deque<std::string> log_;
  SeqId next_id_ = 1;
  std::int64_t op_ = 0;
  RunStats stats_;
};

class RecurrentContentTest : public ::testing::TestWithParam<HybridConfig> {};

TEST_P(RecurrentContentTest, EveryWorkingStateHoldsItsOwnPrefix) {
  const HybridConfig& config = GetParam();
  const std::int64_t ops = OperationsPerConfig();
  HybridRun run(config, ops);
  const RunStats s = run.Run();
  std::ostringstream line;
  line << "[recurrent] " << config.name << " seed " << config.EffectiveSeed() << ": " << s.operations << " ops, "
       << s.stale << " stale, " << s.anomalies << " anomalies, " << s.states_checked << " states checked, " << s.hits
       << "/" << s.adds << " hits (" << s.resumed_checked << " resumed checked, " << s.multi_turn_adds
       << " multi-turn adds, " << s.final_lengths << " with a final length, " << s.host_restores << " from host), " << s.chunked_adds << " chunked adds, " << s.chunks
       << " chunks (" << s.chunks_unlimited << " unlimited, " << s.chunk_batches << " batched), " << s.decode_steps
       << " decode steps, " << s.mixed_steps << " mixed, " << s.forks << " forks (" << s.fork_children << " children, "
       << s.beam_steps << " beam steps), " << s.rewinds_ok << " rewinds ok / " << s.rewinds_refused << " refused, "
       << s.out_of_blocks << " out-of-blocks (" << s.out_of_blocks_admission << " admissions), " << s.batch_full
       << " batch-full refusals, " << s.removes << " removes, " << s.stores << " stores, " << s.drains << " drains, "
       << s.resets << " resets (" << s.resets_refused << " refused), copies " << s.saved_copies << " saved + "
       << s.taken_copies << " by the engine; checkpoints " << s.checkpoints_stored << " stored, "
       << s.checkpoints_restored << " restored, " << s.checkpoints_skipped << " skipped, " << s.checkpoints_evicted
       << " evicted, " << s.checkpoints_offloaded << " offloaded; lost hit tokens " << s.lost_attention
       << " attention, " << s.lost_sliding << " sliding, " << s.lost_checkpoint << " no checkpoint";
  std::printf("%s\n", line.str().c_str());
  RecordProperty("operations", static_cast<int>(s.operations));
  RecordProperty("stale_reads", static_cast<int>(s.stale));
  RecordProperty("hits", static_cast<int>(s.hits));
  Totals& t = GlobalTotals();
  ++t.configs;
  t.operations += s.operations;
  t.stale += s.stale;
  t.anomalies += s.anomalies;
  t.hits += s.hits;
  t.resumed_checked += s.resumed_checked;
  t.forks += s.forks;
  t.rewinds_ok += s.rewinds_ok;
  t.checkpoints_evicted += s.checkpoints_evicted;
  t.out_of_blocks += s.out_of_blocks;
  EXPECT_EQ(s.anomalies, 0) << s.first_anomaly;
  EXPECT_EQ(s.stale, 0);
  EXPECT_EQ(s.operations, ops);
  // Not vacuous: every mechanism ran, and many times.
  EXPECT_GE(s.hits, ops / 200) << "too few prefix hits resumed from checkpoints";
  EXPECT_EQ(s.resumed_checked, s.hits) << "a hit whose restored state was never checked";
  EXPECT_GE(s.checkpoints_restored, s.hits);
  EXPECT_GE(s.multi_turn_adds, ops / 200);
  EXPECT_GE(s.forks, ops / 200) << "too few forks";
  EXPECT_GE(s.beam_steps, ops / 500);
  EXPECT_GE(s.rewinds_ok, ops / 1000) << "too few successful rewinds";
  EXPECT_GE(s.rewinds_refused, ops / 500) << "too few refused rewinds";
  EXPECT_GT(s.out_of_blocks_admission, 0) << "no admission ran out of attention blocks";
  EXPECT_GT(s.lost_attention + s.lost_sliding, 0) << "no attention block of a cached prefix was evicted";
  EXPECT_GT(s.checkpoints_evicted + s.checkpoints_offloaded, 0) << "no checkpoint was evicted";
  EXPECT_GT(s.checkpoints_skipped, 0) << "no checkpoint was skipped";
  EXPECT_GT(s.saved_copies, 0);
  EXPECT_GT(s.taken_copies, 0);
  EXPECT_GT(s.chunks_unlimited, 0);
  EXPECT_GT(s.chunk_batches, 0);
  EXPECT_GT(s.mixed_steps, 0);
  EXPECT_GT(s.final_lengths, 0);
  EXPECT_GT(s.resets, 0);
  EXPECT_GT(s.resets_refused, 0);
  EXPECT_GT(s.batch_full, 0);
  if (config.host_slots > 0) {
    EXPECT_GT(s.checkpoints_offloaded, 0) << "no checkpoint moved to the host";
    EXPECT_GT(s.host_restores, 0) << "no hit restored from a host checkpoint";
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic edge cases found while building the randomized run.

KVCacheManager SmallHybrid(std::vector<std::int32_t> windows = {0}) {
  ModelSpec model = testing::Model(static_cast<std::int32_t>(windows.size()), {1}, 2);
  model.recurrent_layers = {{kConv}, {kHalf}};
  std::map<WindowSize, std::int32_t> primary;
  for (const std::int32_t w : windows) primary[w <= 0 ? kMaxSeqLen : w] = 32;
  ManagerConfig c = testing::Config(windows, kMaxSeqLen, primary, 4);
  c.enable_block_reuse = true;
  c.max_batch_size = 2;
  c.state_slots = 5;
  return KVCacheManager(model, c);
}

// Rewind(id, 0) drops nothing, yet on a model with recurrent layers it throws unless a ready
// checkpoint sits exactly at the current length (RewindCheckpoint looks one up for every
// new_len, 0 tokens included); without recurrent layers it is a no-op. Expected: a no-op (no
// restore, nothing dropped) like for attention-only models; actual: std::invalid_argument
// "... cannot go back to 7 tokens without a checkpoint taken there" for a 7-token sequence.
TEST(RecurrentEdgeCases, RewindByZeroTokensIsANoOp) {
  KVCacheManager m = SmallHybrid();
  const std::vector<TokenId> t = testing::Iota(6);
  m.AddSequence(1, t.data(), t.size());
  m.SaveCheckpoints();
  m.AddToken(1, 9);
  m.SaveCheckpoints();
  m.Rewind(1, 0);
  EXPECT_EQ(m.NumTokens(1), 7);
  m.CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Configs, RecurrentContentTest, ::testing::ValuesIn(HybridConfigs()),
                         [](const ::testing::TestParamInfo<HybridConfig>& param) { return param.param.name; });

}  // namespace
}  // namespace kvcache
