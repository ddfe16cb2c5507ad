// Stale-KV tests: every position a request can attend must hold the KV of that request's own
// prefix, never the KV of another prefix. CheckInvariants cannot see this (it checks the block
// bookkeeping, not the bytes), so a fake engine plays the model on the host backend: for every
// token position i it computes, it writes a tag of (LoRA id, cache salt, tokens[0..i]) into K and
// a per-layer function of that tag into V, in every layer, and it reads back every position a
// request can attend:
//   - right after AddSequence, every position below the returned reused length that a window
//     holds (reused full blocks and the copied or taken-over positions of a partial block);
//   - after the prefill, after every chunk of a chunked prefill (Prefill) and after every decode
//     step (when the KV of the newest token has been written), every position the new queries
//     attend in every window W (everything for full attention).
// Besides stale reads it reports: attended positions without a block, a failed call (out of
// blocks, refused rewind) that changed the manager's state, and, under
// SwaReusePolicy::kInvalidate, a request that is still valid for reuse after another request
// wrote into a block it had released out of window (its KV there is gone).
//
// A. Deterministic regressions: the known stale-KV causes, then API edge cases.
// B. A seeded randomized engine run over many configurations (windows, tokens per block, partial
//    reuse and copy, pool sizes, offload, speculative drafts, sliding-window reuse policy, chunked
//    prefill, pins dropped exactly as returned: nothing stays referenced at the end), with forks
//    (ForkSequence, beam search) in every configuration: a live request, decoding or in chunked
//    prefill, forks into 1..3 children that then often step together in one AddTokens call with
//    different tokens; children are pruned (Remove), decode, draft, rewind, store and pin like any
//    request, and after every step or chunk every fork of the writers (its "family") is checked
//    too: each reads its own tokens' KV, never a sibling's.
//
// Knobs (environment variables):
//   KVCACHE_CONTENT_OPS=N   long mode: the randomized configurations together run at least N
//                           operations (default: 50,000 in total, the CI budget).
//   KVCACHE_CONTENT_SEED=S  added to every configuration's seed (default 0), to explore other runs.
// Every randomized configuration prints its counts (operations, stale reads, ...) and the process
// prints the totals when it ends.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

constexpr BlockId N = kNullBlock;

// ---------------------------------------------------------------------------------------------
// Tags: the KV that position i of a request must hold.

std::uint64_t Mix64(std::uint64_t h, std::uint64_t v) {
  std::uint64_t x = h * 0x9e3779b97f4a7c15ull + v + 0x632be59bd9b4e019ull;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The tag "before position 0": the extras that take part in every block key of the request.
std::uint64_t ExtrasTag(const ReuseExtras& extras) {
  const std::uint64_t lora = extras.lora_task_id ? static_cast<std::uint64_t>(*extras.lora_task_id) + 1 : 0;
  const std::uint64_t salt = extras.cache_salt ? *extras.cache_salt + 1 : 0;
  return Mix64(Mix64(0x6b7663616368652eull, lora), salt);
}

// V holds another function of the tag, different per layer, so a K/V or layer mix-up shows too.
std::uint64_t ValueTag(std::uint64_t tag, std::int32_t layer) {
  return Mix64(tag ^ 0xa5a5a5a55a5a5a5aull, static_cast<std::uint64_t>(layer) + 1);
}

// A request as the engine sees it: tokens, the tag of every position, what it has computed.
struct Request {
  std::vector<TokenId> tokens;
  std::vector<std::uint64_t> tags;  // tags[i]: tag of tokens[0..i] (and the extras)
  ReuseExtras extras;
  std::int32_t prompt_len = 0;
  std::int32_t filled = 0;   // positions [0, filled) have blocks (< size() during chunked prefill)
  std::int32_t written = 0;  // positions [0, written) hold this request's KV
  std::vector<std::vector<BlockId>> blocks;  // per window index, as of the last call on it
  // (window index, block) it released out of window that still hold its KV, as far as the
  // engine knows (no other request has written into them since).
  std::set<std::pair<std::size_t, BlockId>> released;
  SeqId family = -1;  // the request it was forked from, transitively (itself if not forked)

  std::int32_t size() const { return static_cast<std::int32_t>(tokens.size()); }
  bool InPrefill() const { return filled < size(); }
  void Append(TokenId t) {
    tags.push_back(Mix64(tags.empty() ? ExtrasTag(extras) : tags.back(), static_cast<std::uint64_t>(t)));
    tokens.push_back(t);
  }
  void Truncate(std::int32_t len) {
    tokens.resize(static_cast<std::size_t>(len));
    tags.resize(static_cast<std::size_t>(len));
    filled = std::min(filled, len);
    written = std::min(written, len);
  }
};

// Something the engine saw that a correct manager never shows.
struct Anomaly {
  std::string what;     // "stale read", "missing block", ...
  std::string context;  // who was running (config, seed, operation)
  std::string phase;    // reused / prefill / decode / call name
  SeqId seq = -1;
  WindowSize window = 0;
  std::int32_t layer = -1;
  std::int32_t position = -1;
  BlockId block = N;
  std::uint64_t want = 0;
  std::uint64_t got = 0;

  std::string ToString() const {
    std::ostringstream os;
    os << what;
    if (!context.empty()) os << " [" << context << "]";
    os << " " << phase << ": seq " << seq;
    if (block != N || position >= 0) os << " window " << window;
    if (layer >= 0) os << " layer " << layer;
    if (position >= 0) os << " position " << position;
    if (block != N || position >= 0) os << " block " << block;
    if (want != got) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " want %016" PRIx64 " got %016" PRIx64, want, got);
      os << buf;
    }
    return os.str();
  }
};

// ---------------------------------------------------------------------------------------------
// The fake engine: drives a manager like an inference engine, writes and checks KV tags.

class FakeEngine {
 public:
  FakeEngine(const ModelSpec& model, const ManagerConfig& config)
      : m_(model, config), invalidate_policy_(config.swa_reuse_policy == SwaReusePolicy::kInvalidate) {
    m_.SetFakeTimeMs(0);
    const auto& windows = m_.window_sizes();
    layers_.resize(windows.size());
    const std::vector<PoolInfo> pools = m_.pools();
    for (std::int32_t layer = 0; layer < model.num_layers; ++layer) {
      const WindowSize w = pools[static_cast<std::size_t>(m_.layer_to_pool()[static_cast<std::size_t>(layer)].first)].window;
      const auto wi = static_cast<std::size_t>(std::find(windows.begin(), windows.end(), w) - windows.begin());
      layers_[wi].push_back(LayerSlot{layer, m_.GetLayerView(layer)});
    }
  }

  KVCacheManager& manager() { return m_; }
  const std::map<SeqId, Request>& live() const { return live_; }
  const Request& request(SeqId id) const { return live_.at(id); }
  void set_context(std::string context) { context_ = std::move(context); }
  std::int64_t num_anomalies() const { return num_anomalies_; }
  std::int64_t num_stale_reads() const { return num_stale_reads_; }
  std::int64_t positions_checked() const { return positions_checked_; }
  bool clean() const { return num_anomalies_ == 0; }

  std::string Describe() const {
    std::ostringstream os;
    os << num_anomalies_ << " anomalies, " << num_stale_reads_ << " of them stale reads";
    for (const Anomaly& a : first_stale_) os << "\n  " << a.ToString();
    for (const Anomaly& a : first_other_) os << "\n  " << a.ToString();
    return os.str();
  }

  /// AddSequence (with `prefill`: its first chunk only), then the checks of the reused positions,
  /// the prefill of the tokens that have blocks and its window check.
  /// With `prepared`, through a PreparedPrompt (keyed once) instead of raw tokens: for odd ids a
  /// shared one that only the sequence keeps afterwards (its tokens are not copied), for even
  /// ids a copied one.
  std::int32_t Add(SeqId id, const std::vector<TokenId>& prompt, const SequenceOptions& options = {},
                   std::optional<std::int32_t> prefill = std::nullopt, bool prepared = false) {
    const std::int32_t reused = Guarded("AddSequence", [&] {
      if (!prepared) return m_.AddSequence(id, prompt.data(), prompt.size(), options, prefill);
      PreparedPrompt p = m_.Prepare(prompt.data(), prompt.size(), options.extras);
      if (id % 2 == 0) return m_.AddSequence(id, p, options, prefill);
      return m_.AddSequence(id, std::make_shared<const PreparedPrompt>(std::move(p)), options, prefill);
    });
    Request& r = live_[id];
    r.family = id;
    r.extras = options.extras;
    for (const TokenId t : prompt) r.Append(t);
    r.prompt_len = r.size();
    r.filled = m_.NumTokens(id);
    r.written = reused;
    if (r.filled != (prefill ? std::min(r.size(), reused + *prefill) : r.size())) {
      Report(Anomaly{"wrong first chunk", context_, "AddSequence", id});
    }
    Observe(id);
    if (reused < 0 || reused >= r.size()) Report(Anomaly{"bad reused length", context_, "AddSequence", id});
    CheckReused(id, reused);
    WritePending({id});
    CheckWindows(id, std::max(0, reused), "prefill");
    return reused;
  }

  /// The next chunk of a prompt: Prefill, then its KV, then what its queries attend.
  void PrefillChunk(SeqId id, std::int32_t num_tokens) { PrefillChunks({id}, {num_tokens}); }

  /// A step's chunks: one Prefill call for all (a single one through the one-sequence
  /// overload), then their KV (all writes first, as in Step), then what each chunk's queries
  /// attend.
  void PrefillChunks(const std::vector<SeqId>& ids, const std::vector<std::int32_t>& num_tokens) {
    Guarded("Prefill", [&] {
      if (ids.size() == 1) return m_.Prefill(ids[0], num_tokens[0]);
      m_.Prefill(ids.data(), num_tokens.data(), ids.size());
    });
    std::vector<std::int32_t> anchors;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      Request& r = live_.at(ids[i]);
      anchors.push_back(r.filled);
      r.filled += num_tokens[i];
      if (m_.NumTokens(ids[i]) != r.filled) Report(Anomaly{"wrong chunk end", context_, "Prefill", ids[i]});
      Observe(ids[i]);
    }
    WritePending(ids);
    // A chunk's first query sits at position `anchor` and attends [anchor + 1 - W, anchor]:
    // the window of a sequence of anchor + 1 tokens.
    for (std::size_t i = 0; i < ids.size(); ++i) CheckWindows(ids[i], anchors[i] + 1, "chunk");
    CheckFamilies(ids, "chunk (fork)");
  }

  /// One decode step of a batch: AddTokens, then the KV of each new token, then the checks
  /// (of the forks of the batch's requests too: a write into a block a fork shares shows there).
  void Step(const std::vector<SeqId>& ids, const std::vector<TokenId>& tokens) {
    Guarded("AddTokens", [&] { m_.AddTokens(ids.data(), tokens.data(), ids.size()); });
    for (std::size_t i = 0; i < ids.size(); ++i) {
      live_.at(ids[i]).Append(tokens[i]);
      ++live_.at(ids[i]).filled;
      Observe(ids[i]);
    }
    // All writes first: a write that lands in another batch member's block must show.
    WritePending(ids);
    for (const SeqId id : ids) CheckWindows(id, live_.at(id).size(), "decode");
    CheckFamilies(ids, "decode (fork)");
  }

  /// ForkSequence: each child is its parent's copy (tokens, KV, release records), then reads
  /// what its parent attends: the parent's own KV, through the shared blocks.
  void Fork(SeqId parent, const std::vector<SeqId>& children) {
    Guarded("ForkSequence", [&] { m_.ForkSequence(parent, children.data(), children.size()); });
    for (const SeqId c : children) {
      live_[c] = live_.at(parent);
      Observe(c);
      if (Blocks(c) != Blocks(parent)) Report(Anomaly{"fork does not share the parent's blocks", context_, "fork", c});
      CheckWindows(c, live_.at(c).filled, "fork");
    }
  }
  void Step(SeqId id, TokenId token) { Step(std::vector<SeqId>{id}, std::vector<TokenId>{token}); }

  void Rewind(SeqId id, std::int32_t num_tokens) {
    Guarded("Rewind", [&] { m_.Rewind(id, num_tokens); });
    Request& r = live_.at(id);
    r.Truncate(r.size() - num_tokens);
    Observe(id);
  }

  std::int32_t StoreContext(SeqId id) {
    return Guarded("StoreContextBlocks", [&] { return m_.StoreContextBlocks(id); });
  }
  std::int64_t StoreContext(const std::vector<SeqId>& ids) {
    return Guarded("StoreContextBlocks", [&] { return m_.StoreContextBlocks(ids.data(), ids.size()); });
  }

  std::map<WindowSize, std::vector<BlockId>> Pin(SeqId id) {
    return Guarded("PinBlocks", [&] { return m_.PinBlocks(id); });
  }

  std::map<WindowSize, std::vector<BlockId>> Remove(SeqId id, bool store_for_reuse, bool pin = false) {
    auto pinned = Guarded("RemoveSequence", [&] { return m_.RemoveSequence(id, store_for_reuse, pin); });
    live_.erase(id);
    return pinned;
  }

  /// Block list of `id` per window index.
  std::vector<std::vector<BlockId>> Blocks(SeqId id) const {
    std::vector<std::vector<BlockId>> out;
    for (const WindowSize w : m_.window_sizes()) out.push_back(m_.GetCacheBlockIds(id, w));
    return out;
  }

 private:
  struct LayerSlot {
    std::int32_t layer;
    LayerView view;
  };
  // Everything the snapshot of test_util.h sees, plus the size of the reuse tree.
  struct State {
    testing::Snapshot snapshot;
    std::int64_t cached_nodes = 0;
    bool operator==(const State& o) const { return snapshot == o.snapshot && cached_nodes == o.cached_nodes; }
  };

  State Capture() const {
    std::vector<SeqId> ids;
    for (const auto& kv : live_) ids.push_back(kv.first);
    return State{testing::Take(m_, ids), m_.GetStats().num_cached_nodes};
  }

  // Runs a mutating call; a call that fails with the documented errors must change nothing.
  template <typename F>
  auto Guarded(const char* call, F&& f) -> decltype(f()) {
    const State before = Capture();
    try {
      return f();
    } catch (const OutOfBlocksError&) {
      if (!(Capture() == before)) Report(Anomaly{"failed call changed state", context_, call});
      throw;
    } catch (const std::invalid_argument&) {
      if (!(Capture() == before)) Report(Anomaly{"failed call changed state", context_, call});
      throw;
    }
  }

  // Keeps the first few of each kind: stale reads, and everything else.
  void Report(Anomaly a) {
    ++num_anomalies_;
    const bool stale = a.what.rfind("stale read", 0) == 0;
    num_stale_reads_ += stale ? 1 : 0;
    auto& kept = stale ? first_stale_ : first_other_;
    if (kept.size() < 6) kept.push_back(std::move(a));
  }

  unsigned char* Element(const LayerView& v, BlockId b, int kv, std::int32_t offset, int half) const {
    return static_cast<unsigned char*>(v.data) + b * v.strides[0] + kv * v.strides[1] + offset * v.strides[3] +
           half * v.strides[4];
  }
  // A 64-bit tag lives in the two float32 elements of head_dim: low half first.
  std::uint64_t Read(const LayerView& v, BlockId b, int kv, std::int32_t offset) const {
    std::uint32_t lo = 0;
    std::uint32_t hi = 0;
    std::memcpy(&lo, Element(v, b, kv, offset, 0), 4);
    std::memcpy(&hi, Element(v, b, kv, offset, 1), 4);
    return static_cast<std::uint64_t>(hi) << 32 | lo;
  }
  void Write(const LayerView& v, BlockId b, int kv, std::int32_t offset, std::uint64_t tag) {
    const auto lo = static_cast<std::uint32_t>(tag);
    const auto hi = static_cast<std::uint32_t>(tag >> 32);
    std::memcpy(Element(v, b, kv, offset, 0), &lo, 4);
    std::memcpy(Element(v, b, kv, offset, 1), &hi, 4);
  }

  bool ValidBlock(std::size_t w, BlockId b) const { return b >= 0 && b < layers_[w].front().view.shape[0]; }

  // Refreshes the block lists of `id`: entries that became null were released out of window.
  void Observe(SeqId id) {
    Request& r = live_.at(id);
    auto now = Blocks(id);
    for (std::size_t w = 0; w < now.size() && w < r.blocks.size(); ++w) {
      for (std::size_t j = 0; j < now[w].size() && j < r.blocks[w].size(); ++j) {
        if (r.blocks[w][j] != N && now[w][j] == N) r.released.insert({w, r.blocks[w][j]});
      }
    }
    for (std::size_t w = 0; w < now.size(); ++w) {
      for (const BlockId b : now[w]) r.released.erase({w, b});  // its own again
    }
    r.blocks = std::move(now);
  }

  // The engine is about to overwrite block b of window w for `writer`. Any other request that
  // released b out of window lost that KV: under kInvalidate it must no longer be valid for
  // reuse (else it stores the rest of its chain, and its released entry may even be re-stored).
  void CheckReleasers(SeqId writer, std::size_t w, BlockId b) {
    for (auto& [id, r] : live_) {
      if (id == writer || r.released.erase({w, b}) == 0) continue;
      if (invalidate_policy_ && m_.IsSequenceValidForReuse(id)) {
        Report(Anomaly{"releaser still valid", context_, "write", id, m_.window_sizes()[w], -1, -1, b});
      }
    }
  }

  // Computes (writes) the KV of positions [written, size) of each request.
  void WritePending(const std::vector<SeqId>& ids) {
    const std::int32_t tpb = m_.tokens_per_block();
    for (const SeqId id : ids) {
      Request& r = live_.at(id);
      const auto blocks = Blocks(id);
      for (std::int32_t p = r.written; p < r.filled; ++p) {
        for (std::size_t w = 0; w < blocks.size(); ++w) {
          const BlockId b = blocks[w][static_cast<std::size_t>(p / tpb)];
          if (!ValidBlock(w, b)) {
            Report(Anomaly{"no block to write", context_, "write", id, m_.window_sizes()[w], -1, p, b});
            continue;
          }
          CheckReleasers(id, w, b);
          for (const LayerSlot& slot : layers_[w]) {
            Write(slot.view, b, 0, p % tpb, r.tags[static_cast<std::size_t>(p)]);
            Write(slot.view, b, 1, p % tpb, ValueTag(r.tags[static_cast<std::size_t>(p)], slot.layer));
          }
        }
      }
      r.written = std::max(r.written, r.filled);
    }
  }

  // After `ids` wrote: every other live request of their families (forks of one another) still
  // reads its own KV where it attends (a sibling that wrote a block they share did not copy it).
  void CheckFamilies(const std::vector<SeqId>& ids, const char* phase) {
    std::set<SeqId> families;
    for (const SeqId id : ids) families.insert(live_.at(id).family);
    for (const auto& [id, r] : live_) {
      if (families.count(r.family) == 0 || std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
      CheckWindows(id, r.filled, phase);
    }
  }

  // Position p of window w (block b) must hold request id's tag in every layer, K and V.
  void CheckPosition(SeqId id, std::size_t w, BlockId b, std::int32_t p, const char* phase) {
    ++positions_checked_;
    const WindowSize window = m_.window_sizes()[w];
    if (!ValidBlock(w, b)) {
      Report(Anomaly{b == N ? "missing block" : "invalid block", context_, phase, id, window, -1, p, b});
      return;
    }
    const std::uint64_t want = live_.at(id).tags[static_cast<std::size_t>(p)];
    const std::int32_t offset = p % m_.tokens_per_block();
    for (const LayerSlot& slot : layers_[w]) {
      const std::uint64_t k = Read(slot.view, b, 0, offset);
      const std::uint64_t v = Read(slot.view, b, 1, offset);
      if (k != want) {
        Report(Anomaly{"stale read (K)", context_, phase, id, window, slot.layer, p, b, want, k});
        return;
      }
      if (v != ValueTag(want, slot.layer)) {
        Report(Anomaly{"stale read (V)", context_, phase, id, window, slot.layer, p, b, ValueTag(want, slot.layer), v});
        return;
      }
    }
  }

  // Every position below `reused` that a window holds is this prompt's prefix.
  void CheckReused(SeqId id, std::int32_t reused) {
    const std::int32_t tpb = m_.tokens_per_block();
    const auto blocks = Blocks(id);
    for (std::size_t w = 0; w < blocks.size(); ++w) {
      for (std::int32_t p = 0; p < reused && p < live_.at(id).size(); ++p) {
        const BlockId b = blocks[w][static_cast<std::size_t>(p / tpb)];
        if (b != N) CheckPosition(id, w, b, p, "reused");
      }
    }
  }

  // What a query at position anchor - 1 and every later computed position attend: [max(0, anchor - W), filled)
  // per window W (a decode step passes the new length; a chunk its first position + 1).
  void CheckWindows(SeqId id, std::int32_t anchor, const char* phase) {
    const std::int32_t tpb = m_.tokens_per_block();
    const auto blocks = Blocks(id);
    const std::int32_t n = live_.at(id).filled;
    for (std::size_t w = 0; w < blocks.size(); ++w) {
      const std::int32_t from = std::max(0, anchor - m_.window_sizes()[w]);
      for (std::int32_t p = from; p < n; ++p) {
        CheckPosition(id, w, blocks[w][static_cast<std::size_t>(p / tpb)], p, phase);
      }
    }
  }

  KVCacheManager m_;
  bool invalidate_policy_;
  std::vector<std::vector<LayerSlot>> layers_;  // per window index
  std::map<SeqId, Request> live_;
  std::string context_;
  std::vector<Anomaly> first_stale_;
  std::vector<Anomaly> first_other_;
  std::int64_t num_anomalies_ = 0;
  std::int64_t num_stale_reads_ = 0;
  std::int64_t positions_checked_ = 0;
};

ModelSpec TagModel(std::int32_t num_layers) {
  ModelSpec model = testing::Model(num_layers, {1}, /*head_dim=*/2);
  model.dtype = DType::kFloat32;
  return model;
}

ManagerConfig ReuseConfig(std::vector<std::int32_t> windows, std::int32_t max_seq_len,
                          std::map<WindowSize, std::int32_t> primary, std::int32_t tpb = 4) {
  ManagerConfig c = testing::Config(std::move(windows), max_seq_len, std::move(primary), tpb);
  c.enable_block_reuse = true;
  return c;
}

std::vector<TokenId> Tokens(std::initializer_list<TokenId> t) { return std::vector<TokenId>(t); }

// ---------------------------------------------------------------------------------------------
// A. Known causes of stale KV (they fail on the code they were written against).

// Cause 1, takeover form: Y takes over X's out-of-window block without a new generation, so X's
// removal stores it again although Y has overwritten position 3.
TEST(StaleKvRegressionTest, PartialTakeoverOfOutOfWindowBlockIsNotStoredByItsReleaser) {
  for (const SwaReusePolicy policy : {SwaReusePolicy::kPlaceholder, SwaReusePolicy::kInvalidate}) {
    SCOPED_TRACE(policy == SwaReusePolicy::kInvalidate ? "invalidate" : "placeholder");
    ManagerConfig c = ReuseConfig({4, 0}, 32, {{4, 8}, {32, 8}});
    c.swa_reuse_policy = policy;
    FakeEngine e(TagModel(2), c);
    e.Add(1, Tokens({11, 12, 13, 14, 15}));
    ASSERT_EQ(e.StoreContext(1), 1);
    for (const TokenId t : {20, 21, 22}) e.Step(1, t);
    ASSERT_EQ(e.Blocks(1)[0], (std::vector<BlockId>{N, 1}));  // block 0 left the window
    ASSERT_EQ(e.Add(2, Tokens({11, 12, 13, 99})), 3);             // partial reuse of block 0
    ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{0}));        // taken over, not copied
    e.Remove(1, /*store_for_reuse=*/true);
    e.Add(3, Tokens({11, 12, 13, 14, 16}));  // must not read 99's KV at position 3
    EXPECT_TRUE(e.clean()) << e.Describe();
    e.manager().CheckInvariants();
  }
}

// Cause 1, copy form: the free source of a partial copy is the next victim, so it is taken over
// in place (block 0 is the only free block of window 4), again without a new generation.
TEST(StaleKvRegressionTest, PartialReuseOfNextVictimIsNotStoredByItsReleaser) {
  FakeEngine e(TagModel(2), ReuseConfig({4, 0}, 32, {{4, 3}, {32, 8}}));
  e.Add(1, Tokens({11, 12, 13, 14, 15, 16, 17, 18, 19}));
  ASSERT_EQ(e.StoreContext(1), 2);  // [11..14] -> [15..18]: block 0 is not a leaf
  e.Step(1, 20);
  ASSERT_EQ(e.Blocks(1)[0], (std::vector<BlockId>{N, 1, 2}));
  ASSERT_EQ(e.manager().GetNumFreeBlocks(4), 1);
  ASSERT_EQ(e.Add(2, Tokens({11, 12, 13, 99})), 3);
  ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{0}));
  ASSERT_EQ(e.Blocks(2)[1], (std::vector<BlockId>{3}));  // full attention copied
  e.Remove(1, /*store_for_reuse=*/true);
  e.Add(3, Tokens({11, 12, 13, 14, 16}));
  EXPECT_TRUE(e.clean()) << e.Describe();
  e.manager().CheckInvariants();
}

// Cause 2: StoreContextBlocks after a rewind below the prompt stores the old prompt length:
// blocks that now belong to another request.
TEST(StaleKvRegressionTest, StoreContextBlocksAfterRewindBelowPromptStoresOnlyWhatIsLeft) {
  FakeEngine e(TagModel(2), ReuseConfig({4, 0}, 32, {{4, 8}, {32, 8}}));
  const auto prompt = Tokens({1, 2, 3, 4, 5, 6, 7, 8, 9});
  e.Add(1, prompt);
  ASSERT_EQ(e.Blocks(1)[1], (std::vector<BlockId>{0, 1, 2}));
  e.Rewind(1, 6);
  e.Add(2, Tokens({50, 51, 52, 53, 54}));
  ASSERT_EQ(e.Blocks(2)[1], (std::vector<BlockId>{1, 2}));  // the blocks request 1 gave back
  EXPECT_EQ(e.StoreContext(1), 0);                            // 3 tokens: no full block
  e.Add(3, prompt);
  EXPECT_TRUE(e.clean()) << e.Describe();
  e.manager().CheckInvariants();
}

// Cause 2, second form: the stored block is the request's own partial block, which its next
// token is then written into.
TEST(StaleKvRegressionTest, StoreContextBlocksAfterRewindDoesNotCacheTheBlockBeingWritten) {
  FakeEngine e(TagModel(2), ReuseConfig({4, 0}, 32, {{4, 8}, {32, 8}}));
  const auto prompt = Tokens({1, 2, 3, 4, 5, 6, 7, 8, 9});
  e.Add(1, prompt);
  e.Rewind(1, 3);
  EXPECT_LE(e.StoreContext(1), 1);  // 6 tokens: one full block
  e.Step(1, 70);                    // position 6, in place in block 1
  ASSERT_EQ(e.Blocks(1)[1], (std::vector<BlockId>{0, 1}));
  e.Add(2, prompt);
  EXPECT_TRUE(e.clean()) << e.Describe();
  e.manager().CheckInvariants();
}

// Cause 3: B got block 1 of window 4 by reuse and released it out of window; C reclaims it. The
// code this was written against invalidated only the block's recorded owner, A (its first
// acquirer), not B, so under kInvalidate B then stored the rest of its chain. Now every live
// sequence that released the block out of window is invalidated.
TEST(StaleKvRegressionTest, ReclaimOfAReusedOutOfWindowBlockInvalidatesItsReleaser) {
  ManagerConfig c = ReuseConfig({4, 0}, 32, {{4, 6}, {32, 16}});
  c.swa_reuse_policy = SwaReusePolicy::kInvalidate;
  FakeEngine e(TagModel(2), c);
  KVCacheManager& m = e.manager();
  const auto prompt = Tokens({1, 2, 3, 4, 5, 6, 7, 8, 9});
  e.Add(1, prompt);
  e.Remove(1, /*store_for_reuse=*/true);  // [1..4] -> [5..8] in both windows (blocks 0, 1)
  ASSERT_EQ(e.Add(2, prompt), 8);
  ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{N, 1, 3}));
  for (const TokenId t : {10, 11, 12}) e.Step(2, t);
  ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{N, N, 3}));  // block 1 released out of window
  ASSERT_TRUE(m.IsSequenceValidForReuse(2));
  std::vector<TokenId> other(20);
  for (std::size_t i = 0; i < other.size(); ++i) other[i] = static_cast<TokenId>(100 + i);
  e.Add(3, other);
  ASSERT_EQ(e.Blocks(3)[0].back(), 1);  // C reclaimed block 1 with a fresh acquire
  EXPECT_FALSE(m.IsSequenceValidForReuse(2));
  const std::int64_t nodes = m.GetStats().num_cached_nodes;
  const auto cached_sliding = m.CachedBlockHashes(4);
  const auto cached_full = m.CachedBlockHashes(32);
  e.Remove(2, /*store_for_reuse=*/true);
  EXPECT_EQ(m.GetStats().num_cached_nodes, nodes) << "an invalidated request stored blocks";
  EXPECT_EQ(m.CachedBlockHashes(4), cached_sliding);
  EXPECT_EQ(m.CachedBlockHashes(32), cached_full);
  e.Remove(3, /*store_for_reuse=*/false);
  auto longer = prompt;
  for (const TokenId t : {10, 11, 12, 13}) longer.push_back(t);
  e.Add(4, longer);  // whatever it reuses holds its own prefix
  EXPECT_TRUE(e.clean()) << e.Describe();
  m.CheckInvariants();
}

// Beyond the three known causes (found with the randomized test's releaser check): C reuses
// blocks 1 and 2 of window 5 that B released out of window; D's acquire evicts block 0 of the
// same chain, and under kInvalidate the cascade unlinks blocks 1 and 2 although C holds them.
// C rewinds into block 2: private and uncached now, so no copy, and C writes its new tokens in
// place. B's released entry still has block 2's old generation, so B's removal stores block 2
// again, with C's tokens at positions 10 and 11.
TEST(StaleKvRegressionTest, RewindIntoAReusedBlockThatACascadeUnlinkedKeepsTheReleasersKv) {
  ManagerConfig c = ReuseConfig({5, 0}, 32, {{5, 6}, {32, 32}});
  c.swa_reuse_policy = SwaReusePolicy::kInvalidate;
  FakeEngine e(TagModel(2), c);
  const auto prompt = Tokens({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  e.Add(1, prompt);
  e.Remove(1, /*store_for_reuse=*/true);  // three blocks cached: 0, 1, 2 in both windows
  ASSERT_EQ(e.Add(2, prompt), 12);        // B
  ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{N, 1, 2, 4}));
  for (const TokenId t : {20, 21, 22, 23}) e.Step(2, t);
  ASSERT_EQ(e.Blocks(2)[0], (std::vector<BlockId>{N, N, N, 4, 5}));  // 1 and 2 released
  ASSERT_EQ(e.Add(3, prompt), 12);                                    // C
  ASSERT_EQ(e.Blocks(3)[0], (std::vector<BlockId>{N, 1, 2, 3}));
  e.Add(4, Tokens({90, 91}));  // D
  ASSERT_EQ(e.Blocks(4)[0], (std::vector<BlockId>{0}));
  e.Rewind(3, 3);  // 10 tokens: the tail is in block 2
  e.Step(3, 70);
  e.Step(3, 71);
  e.Remove(2, /*store_for_reuse=*/true);
  e.Add(5, prompt);
  EXPECT_TRUE(e.clean()) << e.Describe();
  e.manager().CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// A. API edge cases.

KVCacheManager SmallManager(bool reuse, std::size_t event_buffer = 0) {
  ManagerConfig c = testing::Config({}, 16, {{16, 8}});
  c.enable_block_reuse = reuse;
  c.event_buffer_max_size = event_buffer;
  return KVCacheManager(testing::Model(1), c);
}

// Today slot_offset + n overflows the bounds check and rows are written far before `out`:
// undefined behaviour (UBSan aborts), so the call runs in a child process.
TEST(StaleKvRegressionDeathTest, CopyBlockOffsetsRejectsAHugeSlotOffset) {
  auto call = [] {
    KVCacheManager m = SmallManager(false);
    testing::Add(m, 1, 5);
    std::vector<std::int32_t> out(64, 0);
    const SeqId id = 1;
    try {
      m.CopyBlockOffsets(out.data(), 4, 8, &id, 1, std::numeric_limits<std::int64_t>::max());
    } catch (const std::invalid_argument&) {
      std::_Exit(0);
    } catch (...) {
      std::fprintf(stderr, "threw something other than std::invalid_argument\n");
      std::_Exit(2);
    }
    std::fprintf(stderr, "slot_offset INT64_MAX was accepted\n");
    std::_Exit(1);
  };
  EXPECT_EXIT(call(), ::testing::ExitedWithCode(0), "");
}

TEST(StaleKvRegressionTest, NegativeRequestIdsAreRejected) {
  KVCacheManager m = SmallManager(true);
  const auto prompt = testing::Iota(5);
  EXPECT_THROW(m.AddSequence(-1, prompt.data(), prompt.size()), std::invalid_argument);
  EXPECT_THROW(m.AddSequence(std::numeric_limits<SeqId>::min(), prompt.data(), prompt.size()),
               std::invalid_argument);
  EXPECT_EQ(m.NumSequences(), 0u);
  m.CheckInvariants();
}

TEST(StaleKvRegressionTest, QueriesOfAPromptLongerThanMaxSeqLenAreRejected) {
  KVCacheManager m = SmallManager(true);
  const auto prompt = testing::Iota(17);  // max_seq_len is 16
  EXPECT_THROW(m.AddSequence(1, prompt.data(), prompt.size()), std::invalid_argument);
  EXPECT_THROW(m.GetNumBlocksToAllocate(prompt.data(), prompt.size(), {}), std::invalid_argument);
  EXPECT_THROW(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), std::invalid_argument);
}

TEST(StaleKvRegressionTest, RemoveWithPinNeedsReuse) {
  KVCacheManager m = SmallManager(false);
  testing::Add(m, 1, 9);
  EXPECT_THROW(m.PinBlocks(1), KVCacheError);
  EXPECT_THROW(m.RemoveSequence(1, /*store_for_reuse=*/true, /*pin=*/true), KVCacheError);
  EXPECT_TRUE(m.HasSequence(1)) << "a failed call must change nothing";
  m.CheckInvariants();
}

// A huge timeout must wait (not overflow into "already expired", which is also undefined
// behaviour inside std::chrono: hence the child process). Another thread stores a block after
// about 50 ms; the waiting call must return its event.
TEST(StaleKvRegressionDeathTest, GetLatestEventsWithAHugeTimeoutWaitsForAnEvent) {
  auto call = [] {
    KVCacheManager m = SmallManager(true, /*event_buffer=*/16);
    m.GetLatestEvents(0);  // the Created event
    std::thread producer([&m] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      testing::Add(m, 1, 9);
      m.RemoveSequence(1);  // stores two blocks: one Stored event
    });
    const auto events = m.GetLatestEvents(std::numeric_limits<std::int64_t>::max() / 4);
    producer.join();
    const bool stored = std::any_of(events.begin(), events.end(),
                                    [](const KVCacheEvent& ev) { return ev.kind == EventKind::kStored; });
    if (stored) std::_Exit(0);
    std::fprintf(stderr, "GetLatestEvents returned %zu events and no Stored event\n", events.size());
    std::_Exit(1);
  };
  EXPECT_EXIT(call(), ::testing::ExitedWithCode(0), "");
}

// ---------------------------------------------------------------------------------------------
// B. Randomized engine-style content test.

constexpr std::int32_t kMaxSeqLen = 40;
constexpr std::int32_t kMaxPrompt = kMaxSeqLen - 4;  // room for a few decode steps
constexpr TokenId kVocab = 4;                         // tiny: prefixes collide all the time
constexpr std::int64_t kCiOperations = 50000;

struct ContentConfig {
  std::vector<std::int32_t> windows;  // the layer pattern; 0 = full attention
  std::int32_t tpb = 4;
  std::int32_t layers_per_window = 1;
  bool partial_reuse = true;
  bool copy_on_partial = true;
  std::int32_t secondary = 0;  // per window
  std::int32_t max_draft = 0;
  SwaReusePolicy policy = SwaReusePolicy::kPlaceholder;
  std::int32_t pool_slack = 0;  // extra primary blocks per window
  bool plain_lru = false;       // protect_hit_blocks off
  // lend_free_memory on, and the first window gets twice the layers (so its blocks are twice
  // the size of the others' and a slab is one of its blocks, two of theirs).
  bool lend = false;
  std::uint64_t seed = 0;  // before KVCACHE_CONTENT_SEED is added

  std::uint64_t EffectiveSeed() const {
    const char* offset = std::getenv("KVCACHE_CONTENT_SEED");
    return seed + (offset == nullptr ? 0 : std::strtoull(offset, nullptr, 10));
  }

  std::string Name() const {
    std::ostringstream os;
    os << "w";
    for (const std::int32_t w : windows) os << "_" << (w <= 0 ? std::string("full") : std::to_string(w));
    os << "_tpb" << tpb << "_l" << layers_per_window;
    os << (!partial_reuse ? "_nopartial" : copy_on_partial ? "_copy" : "_nocopy");
    os << "_sec" << secondary << "_draft" << max_draft;
    os << (policy == SwaReusePolicy::kInvalidate ? "_invalidate" : "_placeholder");
    if (plain_lru) os << "_lru";
    if (lend) os << "_lend";
    return os.str();
  }
};

// gtest prints parameters of failing tests: the name says it all.
void PrintTo(const ContentConfig& config, std::ostream* os) { *os << config.Name(); }

std::vector<ContentConfig> ContentConfigs() {
  const std::vector<std::vector<std::int32_t>> window_sets = {{4, 0}, {3, 5, 0}, {6, 2, 9}, {5}};
  std::vector<ContentConfig> out;
  std::uint64_t i = 0;
  for (const auto& windows : window_sets) {
    for (const std::int32_t tpb : {2, 3, 4}) {
      for (int mode = 0; mode < 3; ++mode, ++i) {
        // The binary knobs cycle with different periods, so every window set meets each value
        // of each knob.
        ContentConfig c;
        c.windows = windows;
        c.tpb = tpb;
        c.partial_reuse = mode != 2;
        c.copy_on_partial = mode == 0;
        c.secondary = i % 2 == 0 ? 0 : 4;
        c.max_draft = (i / 2) % 2 == 0 ? 0 : 2;
        c.policy = (i / 4) % 2 == 0 ? SwaReusePolicy::kPlaceholder : SwaReusePolicy::kInvalidate;
        c.layers_per_window = 1 + static_cast<std::int32_t>((i / 3) % 2);
        c.pool_slack = static_cast<std::int32_t>(i % 3);
        c.plain_lru = (i / 8) % 2 == 1;
        c.seed = 0x5eed0000u + i * 7919u;
        out.push_back(c);
      }
    }
  }
  // Windows that lend each other memory: every multi-window set, every block size.
  for (const auto& windows : window_sets) {
    if (windows.size() < 2) continue;
    for (const std::int32_t tpb : {2, 3, 4}) {
      ContentConfig c;
      c.windows = windows;
      c.tpb = tpb;
      c.lend = true;
      c.partial_reuse = i % 3 != 2;
      c.copy_on_partial = i % 3 == 0;
      c.secondary = i % 2 == 0 ? 0 : 4;
      c.max_draft = (i / 2) % 2 == 0 ? 0 : 2;
      c.policy = (i / 4) % 2 == 0 ? SwaReusePolicy::kPlaceholder : SwaReusePolicy::kInvalidate;
      c.pool_slack = static_cast<std::int32_t>(i % 3);
      c.seed = 0x5eed0000u + i * 7919u;
      ++i;
      out.push_back(c);
    }
  }
  return out;
}

std::int64_t EnvInt(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoll(v, nullptr, 10);
}

std::int64_t OperationsPerConfig() {
  const std::int64_t total = std::max<std::int64_t>(EnvInt("KVCACHE_CONTENT_OPS", kCiOperations), 1);
  const auto configs = static_cast<std::int64_t>(ContentConfigs().size());
  return (total + configs - 1) / configs;
}

struct RunStats {
  std::int64_t operations = 0;
  std::int64_t stale = 0;      // positions read with another prefix's KV
  std::int64_t anomalies = 0;  // stale reads and every other anomaly (see FakeEngine)
  std::int64_t positions_checked = 0;
  std::int64_t adds = 0;
  std::int64_t hits = 0;
  std::int64_t partial_hits = 0;  // reused length not block-aligned: a copy or a takeover
  std::int64_t reused_tokens = 0;
  std::int64_t invalidated = 0;  // requests no longer valid for reuse when they ended
  std::int64_t offloaded = 0;
  std::int64_t lent_slabs = 0;  // slabs windows lent each other (lend_free_memory)
  std::int64_t onboarded = 0;
  std::int64_t held_after_drain = 0;  // primary blocks still referenced when everything ended
  std::int64_t out_of_blocks = 0;
  std::int64_t preemptions = 0;
  std::int64_t rewinds_below_prompt = 0;
  std::int64_t rewinds_refused = 0;
  std::int64_t pins = 0;
  std::int64_t unpin_all = 0;
  std::int64_t chunked = 0;  // requests added with a first chunk only
  std::int64_t chunks = 0;   // later Prefill chunks
  std::int64_t chunk_batches = 0;  // Prefill calls with several sequences' chunks
  std::int64_t forks = 0;          // ForkSequence calls (beam search, parallel sampling)
  std::int64_t fork_children = 0;
  std::int64_t beam_steps = 0;     // AddTokens calls over a parent and its new children
  std::int64_t copied_on_write = 0;
  std::string fatal;  // an unexpected exception ended the run
};

// Totals over the process, printed at exit.
struct Totals {
  std::int64_t configs = 0;
  std::int64_t operations = 0;
  std::int64_t stale = 0;
  std::int64_t anomalies = 0;
  std::int64_t configs_with_stale = 0;
  std::int64_t configs_with_anomalies = 0;
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
    std::printf("[stale-kv] total: %" PRId64 " configurations, %" PRId64 " operations, %" PRId64
                " stale reads in %" PRId64 " configurations, %" PRId64 " anomalies in all in %" PRId64
                " configurations\n",
                t.configs, t.operations, t.stale, t.configs_with_stale, t.anomalies, t.configs_with_anomalies);
  }
};
[[maybe_unused]] ::testing::Environment* const kTotalsPrinter =
    ::testing::AddGlobalTestEnvironment(new TotalsPrinter);

class ContentRun {
 public:
  ContentRun(const ContentConfig& config, std::int64_t operations)
      : config_(config), operations_(operations), rng_(config.EffectiveSeed()),
        engine_(Model(config), Manager(config)) {
    for (int b = 0; b < 3; ++b) {
      std::vector<TokenId> base;
      for (std::int32_t i = 0; i < kMaxSeqLen; ++i) base.push_back(RandomToken());
      bases_.push_back(std::move(base));
    }
  }

  RunStats Run() {
    KVCacheManager& m = engine_.manager();
    for (std::int64_t op = 0; op < operations_ && stats_.fatal.empty(); ++op) {
      engine_.set_context(Context(op));
      Attempt([&] { Operation(); });
      Attempt([&] { m.CheckInvariants(); });
      ++stats_.operations;
    }
    if (stats_.fatal.empty()) Attempt([&] { Drain(); });
    stats_.stale = engine_.num_stale_reads();
    stats_.anomalies = engine_.num_anomalies();
    stats_.positions_checked = engine_.positions_checked();
    return stats_;
  }

  std::string Describe() const { return engine_.Describe(); }

 private:
  using PinRecord = std::map<WindowSize, std::vector<BlockId>>;  // what a pin call returned
  struct HistoryEntry {
    std::vector<TokenId> tokens;
    ReuseExtras extras;
  };

  static ModelSpec Model(const ContentConfig& c) {
    return TagModel(static_cast<std::int32_t>(c.windows.size() + (c.lend ? 1 : 0)) * c.layers_per_window);
  }

  static ManagerConfig Manager(const ContentConfig& c) {
    const std::int32_t blocks_per_seq = (kMaxSeqLen + c.tpb - 1) / c.tpb;
    std::map<WindowSize, std::int32_t> primary;
    for (const std::int32_t w : c.windows) {
      const bool full = w <= 0 || w >= kMaxSeqLen;
      // A little over two longest prompts in full attention; sliding windows give blocks back
      // while decoding, so about one longest prompt.
      primary[full ? kMaxSeqLen : w] = (full ? 2 * blocks_per_seq : blocks_per_seq + 2) + c.pool_slack;
    }
    std::vector<std::int32_t> pattern = c.windows;
    if (c.lend) pattern.insert(pattern.begin(), c.windows.front());
    ManagerConfig m = ReuseConfig(pattern, kMaxSeqLen, primary, c.tpb);
    m.lend_free_memory = c.lend;
    for (auto& kv : m.blocks_per_window) kv.second.secondary = c.secondary;
    m.enable_partial_reuse = c.partial_reuse;
    m.copy_on_partial_reuse = c.copy_on_partial;
    m.max_draft_tokens = c.max_draft;
    m.swa_reuse_policy = c.policy;
    m.protect_hit_blocks = !c.plain_lru;
    return m;
  }

  std::string Context(std::int64_t op) const {
    std::ostringstream os;
    os << config_.Name() << " seed " << config_.EffectiveSeed() << " op " << op;
    return os.str();
  }

  // Runs one step of the run; the documented failures are engine events, anything else ends it.
  template <typename F>
  void Attempt(F&& f) {
    if (!stats_.fatal.empty()) return;
    try {
      try {
        f();
      } catch (const OutOfBlocksError&) {
        ++stats_.out_of_blocks;
        Preempt();
      }
    } catch (const std::exception& e) {
      stats_.fatal = Context(stats_.operations) + ": " + e.what();
    }
  }

  std::uint64_t Rand(std::uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Chance(int percent) { return Rand(100) < static_cast<std::uint64_t>(percent); }
  TokenId RandomToken() { return static_cast<TokenId>(Rand(kVocab)); }

  // Greedy decoding: the same prefix continues the same way, most of the time.
  TokenId NextToken(const Request& r) {
    if (Chance(20)) return RandomToken();
    return static_cast<TokenId>((r.tags.back() >> 29) % kVocab);
  }

  SeqId PickLive() {
    auto it = engine_.live().begin();
    std::advance(it, static_cast<std::ptrdiff_t>(Rand(engine_.live().size())));
    return it->first;
  }

  // A live request whose prompt is complete (decode, drafts), or -1.
  SeqId PickDecoding() {
    std::vector<SeqId> ids;
    for (const auto& [id, r] : engine_.live()) {
      if (!r.InPrefill()) ids.push_back(id);
    }
    return ids.empty() ? -1 : ids[Rand(ids.size())];
  }

  void Operation() {
    const std::uint64_t dice = Rand(100);
    if (engine_.live().empty() || dice < 18) return Add();
    if (dice < 30) return PrefillSome();
    if (dice < 46) return Decode();
    if (dice < 52) return ForkSome();
    if (dice < 60) return config_.max_draft > 0 ? Draft() : Decode();
    if (dice < 66) return RewindSome();
    if (dice < 74) return (void)engine_.StoreContext(PickLive());
    if (dice < 77) return Pin();
    if (dice < 80) return Unpin();
    if (dice < 92) return Remove(PickLive(), Chance(85));
    return Refresh();
  }

  ReuseExtras RandomExtras() {
    ReuseExtras e;
    if (Chance(20)) e.lora_task_id = static_cast<std::int64_t>(1 + Rand(2));
    if (Chance(15)) e.cache_salt = 7;
    return e;
  }

  SequenceOptions RandomOptions() {
    SequenceOptions o;
    if (Chance(25)) o.priority = static_cast<int>(Rand(101));
    if (Chance(15)) {
      const auto end = static_cast<std::int32_t>(config_.tpb * (1 + Rand(4)));
      const auto duration = Chance(50) ? 0 : static_cast<std::int64_t>(1 + Rand(5));
      o.priority_ranges = {PriorityRange{0, end, static_cast<int>(Rand(101)), duration}};
    }
    if (Chance(10)) {
      o.decode_priority = static_cast<int>(Rand(101));
      o.decode_duration_ms = static_cast<std::int64_t>(Rand(5));
    }
    return o;
  }

  // A prefix of a shared base or of an earlier request (a follow-up turn), plus a short tail.
  void Add() {
    SequenceOptions options = RandomOptions();
    const std::vector<TokenId>* source = &bases_[Rand(bases_.size())];
    options.extras = RandomExtras();
    if (!history_.empty() && Chance(40)) {
      const HistoryEntry& h = history_[Rand(history_.size())];
      source = &h.tokens;
      if (Chance(80)) options.extras = h.extras;
    }
    const std::size_t keep = 1 + Rand(std::min<std::size_t>(source->size(), kMaxPrompt));
    std::vector<TokenId> prompt(source->begin(), source->begin() + static_cast<std::ptrdiff_t>(keep));
    for (auto tail = Rand(4); tail > 0 && prompt.size() < static_cast<std::size_t>(kMaxPrompt); --tail) {
      prompt.push_back(RandomToken());
    }
    const SeqId id = next_id_++;
    KVCacheManager& m = engine_.manager();
    const std::int32_t predicted = m.GetReusablePrefixLength(prompt.data(), prompt.size(), options.extras);
    // Chunked prefill often: the first chunk is as small as one token or spans a few blocks.
    std::optional<std::int32_t> prefill;
    if (Chance(40)) prefill = static_cast<std::int32_t>(1 + Rand(static_cast<std::uint64_t>(3 * config_.tpb)));
    if (prefill) ++stats_.chunked;
    const bool prepared = Chance(30);
    if (prepared) {
      const PreparedPrompt p = m.Prepare(prompt.data(), prompt.size(), options.extras);
      EXPECT_EQ(m.GetReusablePrefixLength(p), predicted) << Context(stats_.operations) << ": prepared lookup";
      EXPECT_EQ(m.GetNumBlocksToAllocate(p, prefill),
                m.GetNumBlocksToAllocate(prompt.data(), prompt.size(), options.extras, prefill))
          << Context(stats_.operations) << ": prepared block count";
    }
    const std::int32_t reused = engine_.Add(id, prompt, options, prefill, prepared);
    EXPECT_EQ(reused, predicted) << Context(stats_.operations) << ": GetReusablePrefixLength disagrees";
    ++stats_.adds;
    stats_.hits += reused > 0 ? 1 : 0;
    stats_.partial_hits += reused % config_.tpb != 0 ? 1 : 0;
    stats_.reused_tokens += reused;
  }

  // The next chunk of a request in chunked prefill (decode when there is none).
  void PrefillSome() {
    std::vector<SeqId> ids;
    for (const auto& [id, r] : engine_.live()) {
      if (r.InPrefill()) ids.push_back(id);
    }
    if (ids.empty()) return Decode();
    // One request or, most of the time when several are in prefill, several in one call.
    std::vector<SeqId> step;
    if (ids.size() > 1 && Chance(70)) {
      for (const SeqId id : ids) {
        if (Chance(75)) step.push_back(id);
      }
      if (step.size() < 2) step = {ids.front(), ids.back()};
    } else {
      step = {ids[Rand(ids.size())]};
    }
    std::vector<std::int32_t> chunks;
    for (const SeqId id : step) {
      const Request& r = engine_.request(id);
      const std::int32_t left = r.size() - r.filled;
      const auto most = static_cast<std::uint64_t>(std::min(left, 3 * config_.tpb));
      chunks.push_back(static_cast<std::int32_t>(1 + Rand(most)));
    }
    engine_.PrefillChunks(step, chunks);
    stats_.chunks += static_cast<std::int64_t>(step.size());
    stats_.chunk_batches += step.size() > 1 ? 1 : 0;
    if (step.size() > 1 && Chance(50)) engine_.StoreContext(step);  // the step's chunks at once
  }

  // One decode step for a random subset; requests that reach max_seq_len finish.
  void Decode() {
    std::vector<SeqId> ids;
    std::vector<TokenId> tokens;
    for (const auto& [id, r] : engine_.live()) {
      if (!r.InPrefill() && r.size() < kMaxSeqLen && Chance(70)) {
        ids.push_back(id);
        tokens.push_back(NextToken(r));
      }
    }
    if (ids.empty()) return;
    engine_.Step(ids, tokens);
    for (const SeqId id : ids) {
      if (engine_.request(id).size() >= kMaxSeqLen) Remove(id, /*store_for_reuse=*/true);
    }
  }

  // Beam search / parallel sampling: forks a live request (decoding, or in chunked prefill)
  // into 1..3 children; most of the time the family then takes one step in one AddTokens call
  // with a different token each (the beams diverge: every shared partial block is copied but
  // the last holder's). Pruning is Remove; the children decode, draft, rewind, store and pin
  // like any request.
  void ForkSome() {
    if (engine_.live().size() >= 8) return Decode();
    const SeqId parent = PickLive();
    const auto k = static_cast<std::int32_t>(1 + Rand(3));
    std::vector<SeqId> children;
    for (std::int32_t i = 0; i < k; ++i) children.push_back(next_id_++);
    if (Chance(3)) children.push_back(children.front());  // refused: a repeated child id
    try {
      engine_.Fork(parent, children);
    } catch (const std::invalid_argument&) {
      return;  // the engine checked that nothing changed
    }
    ++stats_.forks;
    stats_.fork_children += k;
    const Request& p = engine_.request(parent);
    if (p.InPrefill() || p.size() >= kMaxSeqLen || !Chance(70)) return;
    std::vector<SeqId> family{parent};
    family.insert(family.end(), children.begin(), children.end());
    std::vector<TokenId> tokens;
    for (std::size_t i = 0; i < family.size(); ++i) tokens.push_back(i == 0 ? NextToken(p) : RandomToken());
    engine_.Step(family, tokens);
    ++stats_.beam_steps;
    for (const SeqId id : family) {
      if (engine_.request(id).size() >= kMaxSeqLen) Remove(id, /*store_for_reuse=*/true);
    }
  }

  // Speculative decoding: append up to max_draft guesses, compute them, reject some.
  void Draft() {
    const SeqId id = PickDecoding();
    if (id < 0) return;
    const auto drafts = static_cast<std::int32_t>(1 + Rand(static_cast<std::uint64_t>(config_.max_draft)));
    std::int32_t appended = 0;
    for (; appended < drafts && engine_.request(id).size() < kMaxSeqLen; ++appended) {
      const Request& r = engine_.request(id);
      engine_.Step(id, Chance(50) ? NextToken(r) : RandomToken());
    }
    const auto rejected = static_cast<std::int32_t>(Rand(static_cast<std::uint64_t>(appended) + 1));
    if (rejected == 0) return;
    try {
      engine_.Rewind(id, rejected);
    } catch (const std::invalid_argument& e) {
      // max_draft_tokens promises that rejected drafts can always be dropped.
      ADD_FAILURE() << Context(stats_.operations) << ": rewind of " << rejected << " drafts refused: " << e.what();
    }
  }

  // Rewinds, often below the prompt; refused when a window already released what it needs.
  void RewindSome() {
    const SeqId id = PickLive();
    const Request& r = engine_.request(id);
    if (r.size() < 2) return;
    const std::int32_t small = std::max(1, config_.max_draft);
    const auto k = static_cast<std::int32_t>(
        1 + (Chance(50) ? Rand(static_cast<std::uint64_t>(std::min(small, r.size() - 1)))
                        : Rand(static_cast<std::uint64_t>(r.size() - 1))));
    const bool below_prompt = r.size() - k < r.prompt_len;
    try {
      engine_.Rewind(id, k);
      stats_.rewinds_below_prompt += below_prompt ? 1 : 0;
    } catch (const std::invalid_argument&) {
      ++stats_.rewinds_refused;  // the engine checked that nothing changed
    }
  }

  void Pin() { Record(engine_.Pin(PickLive())); }

  void Remove(SeqId id, bool store_for_reuse) {
    const Request& r = engine_.request(id);
    const bool pin = store_for_reuse && Chance(10);
    HistoryEntry entry{r.tokens, r.extras};
    stats_.invalidated += engine_.manager().IsSequenceValidForReuse(id) ? 0 : 1;
    PinRecord pinned = engine_.Remove(id, store_for_reuse, pin);
    if (pin) Record(std::move(pinned));
    history_.push_back(std::move(entry));
    if (history_.size() > 16) history_.erase(history_.begin());
  }

  void Record(PinRecord pinned) {
    ++stats_.pins;
    pins_.push_back(std::move(pinned));
  }

  // Drops one pin call's pins, exactly as the call returned them: that must always work.
  void UnpinRecord(std::size_t i) {
    const PinRecord record = std::move(pins_[i]);
    pins_.erase(pins_.begin() + static_cast<std::ptrdiff_t>(i));
    try {
      engine_.manager().UnpinBlocks(record);
    } catch (const std::exception& e) {
      ADD_FAILURE() << Context(stats_.operations) << ": unpinning what a pin returned failed: " << e.what();
    }
  }

  void Unpin() {
    if (pins_.empty()) return;
    if (Chance(80)) return UnpinRecord(Rand(pins_.size()));
    UnpinAll();
  }

  void UnpinAll() {
    while (!pins_.empty()) UnpinRecord(pins_.size() - 1);
    ++stats_.unpin_all;
  }

  void Refresh() {
    now_ms_ += static_cast<std::int64_t>(Rand(4));
    engine_.manager().SetFakeTimeMs(now_ms_);
    engine_.manager().RefreshBlocks();
  }

  // Out of blocks: preempt the newest request (a scheduler's choice), or drop the pins.
  void Preempt() {
    ++stats_.preemptions;
    if (engine_.live().empty() || (!pins_.empty() && Chance(30))) {
      UnpinAll();
      return;
    }
    Remove(engine_.live().rbegin()->first, Chance(50));
  }

  // The end: every request leaves and every pin we can still name goes.
  void Drain() {
    while (!engine_.live().empty()) Remove(engine_.live().begin()->first, true);
    UnpinAll();
    KVCacheManager& m = engine_.manager();
    m.CheckInvariants();
    const KvCacheStats stats = m.GetStats();
    stats_.offloaded = stats.offloaded_blocks;
    stats_.onboarded = stats.onboarded_blocks;
    stats_.lent_slabs = stats.lent_slabs;
    stats_.copied_on_write = stats.copied_on_write_blocks;
    // Every pin was dropped exactly as taken: nothing may stay referenced.
    stats_.held_after_drain = stats.used_num_blocks;
  }

  ContentConfig config_;
  std::int64_t operations_;
  std::mt19937_64 rng_;
  FakeEngine engine_;
  std::vector<std::vector<TokenId>> bases_;
  std::vector<HistoryEntry> history_;
  std::vector<PinRecord> pins_;
  SeqId next_id_ = 1;
  std::int64_t now_ms_ = 0;
  RunStats stats_;
};

class StaleKvContentTest : public ::testing::TestWithParam<ContentConfig> {};

TEST_P(StaleKvContentTest, EveryAttendedPositionHoldsItsOwnPrefix) {
  const ContentConfig& config = GetParam();
  ContentRun run(config, OperationsPerConfig());
  const RunStats s = run.Run();
  std::ostringstream line;
  line << "[stale-kv] " << config.Name() << " seed " << config.EffectiveSeed() << ": " << s.operations << " ops, "
       << s.stale << " stale reads, " << s.anomalies << " anomalies, " << s.positions_checked
       << " positions checked, " << s.hits << "/" << s.adds << " hits (" << s.partial_hits << " partial, "
       << s.reused_tokens << " tokens), " << s.out_of_blocks << " out-of-blocks, " << s.rewinds_below_prompt
       << " rewinds below prompt (" << s.rewinds_refused << " refused), " << s.chunked << " chunked prompts ("
       << s.chunks << " more chunks, " << s.chunk_batches << " calls with several), " << s.pins << " pins, "
       << s.invalidated << " invalidated, " << s.offloaded << " offloaded, " << s.onboarded << " onboarded, " << s.lent_slabs << " slabs lent, " << s.forks << " forks (" << s.fork_children << " children, "
       << s.beam_steps << " beam steps, " << s.copied_on_write << " blocks copied on write), " << s.held_after_drain
       << " blocks held after drain";
  std::printf("%s\n", line.str().c_str());
  RecordProperty("operations", static_cast<int>(s.operations));
  RecordProperty("stale_reads", static_cast<int>(s.stale));
  RecordProperty("anomalies", static_cast<int>(s.anomalies));
  Totals& t = GlobalTotals();
  ++t.configs;
  t.operations += s.operations;
  t.stale += s.stale;
  t.anomalies += s.anomalies;
  t.configs_with_stale += s.stale > 0 ? 1 : 0;
  t.configs_with_anomalies += s.anomalies > 0 ? 1 : 0;
  EXPECT_TRUE(s.fatal.empty()) << s.fatal;
  EXPECT_EQ(s.anomalies, 0) << run.Describe();
  EXPECT_GT(s.hits, 0) << "no prefix hit: the run tests nothing";
  EXPECT_GT(s.positions_checked, s.operations);
  EXPECT_GT(s.chunks, 0) << "no chunked prefill";
  EXPECT_GT(s.chunk_batches, 0) << "no step prefilled several requests in one call";
  EXPECT_GT(s.beam_steps, 0) << "no forked family stepped together";
  EXPECT_GT(s.copied_on_write, 0) << "no write copied a shared block";
  if (config.lend) {
    EXPECT_GT(s.lent_slabs, 0) << "no window lent memory: the run tests no lending";
  }
  EXPECT_EQ(s.held_after_drain, 0) << "blocks still referenced after every request ended and every pin was dropped";
}

INSTANTIATE_TEST_SUITE_P(Configs, StaleKvContentTest, ::testing::ValuesIn(ContentConfigs()),
                         [](const ::testing::TestParamInfo<ContentConfig>& param) { return param.param.Name(); });

}  // namespace
}  // namespace kvcache
