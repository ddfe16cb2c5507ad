// RouterIndex (cpp/src/router_index.cpp): the router's native index, fed raw msgpack batches
// as kvcache's publisher (and vLLM) sends them, checked against the rule with exact answers.
#include "kvcache/router_index.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/block_key.h"

namespace kvcache {
namespace {

// ---- A small msgpack writer: just what a KVEventBatch holds ------------------------------
struct Mp {
  std::string out;
  Mp& Byte(unsigned b) {
    out.push_back(static_cast<char>(b));
    return *this;
  }
  Mp& Be(std::uint64_t v, int bytes) {
    for (int k = bytes - 1; k >= 0; --k) Byte(static_cast<unsigned>((v >> (8 * k)) & 0xffU));
    return *this;
  }
  Mp& Nil() { return Byte(0xc0); }
  Mp& Bool(bool b) { return Byte(b ? 0xc3 : 0xc2); }
  Mp& UInt(std::uint64_t v) { return v < 128 ? Byte(static_cast<unsigned>(v)) : Byte(0xcf).Be(v, 8); }
  Mp& Int(std::int64_t v) { return v >= 0 ? UInt(static_cast<std::uint64_t>(v)) : Byte(0xd3).Be(static_cast<std::uint64_t>(v), 8); }
  Mp& Float(double d) {
    std::uint64_t bits = 0;
    static_assert(sizeof bits == sizeof d);
    std::memcpy(&bits, &d, sizeof d);
    return Byte(0xcb).Be(bits, 8);
  }
  Mp& Str(const std::string& s) {
    Byte(0xd9 + 1).Be(s.size(), 2);  // str16
    out += s;
    return *this;
  }
  Mp& Bin(const std::string& s) {
    Byte(0xc4).Be(s.size(), 1);
    out += s;
    return *this;
  }
  Mp& Array(std::size_t n) { return Byte(0xdc).Be(n, 2); }
  Mp& Map(std::size_t n) { return Byte(0xde).Be(n, 2); }
};

struct Stored {
  std::vector<std::uint64_t> hashes;
  std::uint64_t group = 0;
  std::optional<std::uint64_t> window;  // sliding window tokens
  std::string medium = "GPU";
  std::string kind;  // "" -> from window
  std::uint64_t block_size = 4;
};

void PutStored(Mp& m, const Stored& s) {
  m.Map(6).Str("type").Str("BlockStored");
  m.Str("block_hashes").Array(s.hashes.size());
  for (const auto h : s.hashes) m.UInt(h);
  m.Str("block_size").UInt(s.block_size);
  m.Str("medium").Str(s.medium);
  m.Str("group_idx").UInt(s.group);
  const std::string kind = !s.kind.empty() ? s.kind : s.window.has_value() ? "sliding_window" : "full_attention";
  m.Str("kv_cache_spec_kind").Str(kind);
  // (the window follows in a 7th pair when set: written by Batch)
}

void PutRemoved(Mp& m, const std::vector<std::uint64_t>& hashes, std::uint64_t group,
                const std::optional<std::string>& medium) {
  m.Map(4).Str("type").Str("BlockRemoved");
  m.Str("block_hashes").Array(hashes.size());
  for (const auto h : hashes) m.UInt(h);
  m.Str("group_idx").UInt(group);
  m.Str("medium");
  if (medium.has_value()) {
    m.Str(*medium);
  } else {
    m.Nil();
  }
}

struct Ev {
  enum { kStored, kRemoved, kCleared } type;
  Stored stored;
  std::vector<std::uint64_t> removed;
  std::uint64_t group = 0;
  std::optional<std::string> medium = "GPU";
};

Ev S(std::vector<std::uint64_t> h, std::uint64_t group = 0, std::optional<std::uint64_t> window = std::nullopt,
     std::string medium = "GPU") {
  Ev e{Ev::kStored, {}, {}, 0, {}};
  e.stored.hashes = std::move(h);
  e.stored.group = group;
  e.stored.window = window;
  e.stored.medium = std::move(medium);
  return e;
}
Ev R(std::vector<std::uint64_t> h, std::uint64_t group = 0, std::optional<std::string> medium = "GPU") {
  return Ev{Ev::kRemoved, {}, std::move(h), group, std::move(medium)};
}
Ev Cleared() { return Ev{Ev::kCleared, {}, {}, 0, {}}; }

std::string Batch(const std::vector<Ev>& events) {
  Mp m;
  m.Array(3).Float(1.0).Array(events.size());
  for (const Ev& e : events) {
    if (e.type == Ev::kCleared) {
      m.Map(1).Str("type").Str("AllBlocksCleared");
    } else if (e.type == Ev::kRemoved) {
      PutRemoved(m, e.removed, e.group, e.medium);
    } else if (e.stored.window.has_value()) {
      // 7 pairs: rewrite the map header of PutStored's 6.
      Mp inner;
      PutStored(inner, e.stored);
      inner.out[1] = 0;
      inner.out[2] = 7;
      inner.Str("kv_cache_spec_sliding_window").UInt(*e.stored.window);
      m.out += inner.out;
    } else {
      PutStored(m, e.stored);
    }
  }
  m.Nil();
  return m.out;
}

std::vector<TokenId> Prompt(std::size_t n, TokenId first = 0) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<std::uint64_t> Hashes(const std::vector<TokenId>& prompt, std::int32_t tpb = 4) {
  std::vector<std::uint64_t> out;
  const std::size_t keyed = prompt.size() - 1;
  ChainHashes(prompt.data(), keyed - keyed % static_cast<std::size_t>(tpb), tpb, ReuseExtras{}, &out);
  return out;
}

std::vector<std::uint64_t> Slice(const std::vector<std::uint64_t>& v, std::size_t from, std::size_t to) {
  return {v.begin() + static_cast<std::ptrdiff_t>(from), v.begin() + static_cast<std::ptrdiff_t>(to)};
}

std::int32_t Apply(RouterIndex& index, std::int32_t slot, const std::vector<Ev>& events) {
  const std::string b = Batch(events);
  return index.ApplyMsgpack(slot, b.data(), b.size());
}

std::vector<std::int64_t> Scores(const RouterIndex& index, const std::vector<TokenId>& prompt) {
  return index.Scores(prompt.data(), prompt.size(), RouterLookupKey{}, nullptr);
}

TEST(RouterIndex, FullAttentionScoresEveryEngineAndStopsAtTheFirstMiss) {
  RouterIndex index;
  const auto prompt = Prompt(25);  // keyed on 24 tokens: 6 blocks
  const auto h = Hashes(prompt);
  ASSERT_EQ(h.size(), 6U);
  const std::int32_t a = Apply(index, RouterIndex::kNewEngine, {S(Slice(h, 0, 2))});
  const std::int32_t b = Apply(index, RouterIndex::kNewEngine, {S(h)});
  const std::int32_t c = Apply(index, RouterIndex::kNewEngine, {S({h[0], h[1], h[3], h[4]})});
  const std::int32_t d = index.AddEngine();
  EXPECT_EQ((std::vector<std::int32_t>{a, b, c, d}), (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 24, 8, 0}));
  EXPECT_EQ(Scores(index, Prompt(9)), (std::vector<std::int64_t>{8, 8, 8, 0}));
  EXPECT_EQ(Scores(index, Prompt(1)), (std::vector<std::int64_t>{0, 0, 0, 0}));
  const std::vector<std::int32_t> only{c, a};
  EXPECT_EQ(index.Scores(prompt.data(), prompt.size(), RouterLookupKey{}, &only), (std::vector<std::int64_t>{8, 8}));
  // A removal on the only medium takes the block away; another medium keeps it.
  Apply(index, b, {S({h[2]}, 0, std::nullopt, "CPU"), R({h[2]}), R({h[4]}, 0, "CPU")});
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 24, 8, 0}));
  Apply(index, b, {R({h[2]}, 0, "CPU")});
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 8, 8, 0}));
  Apply(index, b, {S({h[2]}, 0, std::nullopt, "DISK"), R({h[2], h[3]}, 0, std::nullopt)});  // nil: every copy
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 8, 8, 0}));
  EXPECT_EQ(index.NumBlocks(b), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 4}}));
  // Clearing one engine leaves the others; removing one frees its slot for the next.
  Apply(index, c, {Cleared()});
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 8, 0, 0}));
  EXPECT_EQ(index.NumBlocks(c), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 0}}));
  index.RemoveEngine(a);
  EXPECT_EQ(index.Engines(), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 0, 0}));
  EXPECT_EQ(Apply(index, RouterIndex::kNewEngine, {S(h)}), 0);  // the lowest free slot
  EXPECT_EQ(index.Engines(), (std::vector<std::int32_t>{1, 2, 3, 0}));
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{8, 0, 0, 24}));
  EXPECT_THROW(index.NumBlocks(a + 7), std::out_of_range);
  const std::vector<std::int32_t> dead{9};
  EXPECT_THROW(index.Scores(prompt.data(), prompt.size(), RouterLookupKey{}, &dead), std::out_of_range);
  // Every entry goes with its last holder.
  for (const std::int32_t s : index.Engines()) index.RemoveEngine(s);
  EXPECT_EQ(index.NumEntries(), 0U);
}

TEST(RouterIndex, SlidingWindowGroupsNeedOnlyTheirLastBlocks) {
  const auto prompt = Prompt(25);
  const auto h = Hashes(prompt);
  RouterIndex index;
  // Group 0: a window of 8 tokens (2 blocks); group 1: full attention.
  const std::int32_t e = Apply(index, RouterIndex::kNewEngine, {S(h, 1), S(Slice(h, 3, 6), 0, 8)});
  EXPECT_EQ(Scores(index, prompt), std::vector<std::int64_t>{24});
  EXPECT_EQ(Scores(index, Prompt(21)), std::vector<std::int64_t>{20});
  EXPECT_EQ(Scores(index, Prompt(17)), std::vector<std::int64_t>{0});
  Apply(index, e, {R({h[4]}, 0)});
  EXPECT_EQ(Scores(index, prompt), std::vector<std::int64_t>{0});
  Apply(index, e, {R({h[2]}, 1), S(h, 0, 8)});
  EXPECT_EQ(Scores(index, prompt), std::vector<std::int64_t>{8});
  // A window of 9 tokens needs 3 blocks; two windows constrain on their own.
  RouterIndex nine;
  Apply(nine, RouterIndex::kNewEngine, {S(h, 1), S(Slice(h, 3, 6), 0, 9)});
  EXPECT_EQ(Scores(nine, prompt), std::vector<std::int64_t>{24});
  EXPECT_EQ(Scores(nine, Prompt(21)), std::vector<std::int64_t>{0});
  RouterIndex two;
  Apply(two, RouterIndex::kNewEngine, {S(Slice(h, 4, 6), 0, 8), S(Slice(h, 2, 6), 1, 16), S(h, 2)});
  // Beside them, a plain full-attention engine in the same lookup.
  Apply(two, RouterIndex::kNewEngine, {S(Slice(h, 0, 3))});
  EXPECT_EQ(Scores(two, prompt), (std::vector<std::int64_t>{24, 12}));
  EXPECT_EQ(Scores(two, Prompt(21)), (std::vector<std::int64_t>{0, 12}));
  // A recurrent state group needs a checkpoint at the hit point.
  RouterIndex state;
  Stored mamba;
  mamba.hashes = {h[1], h[3]};
  mamba.group = 1;
  mamba.kind = "mamba";
  Ev ev = S({});
  ev.stored = mamba;
  Apply(state, RouterIndex::kNewEngine, {S(h), ev});
  EXPECT_EQ(Scores(state, prompt), std::vector<std::int64_t>{16});
  EXPECT_EQ(Scores(state, Prompt(13)), std::vector<std::int64_t>{8});
}

TEST(RouterIndex, TheSharedStoreServesReadersPastTheirLocalHit) {
  const auto prompt = Prompt(25);
  const auto h = Hashes(prompt);
  RouterIndex index;
  const std::int32_t b = index.AddEngine();
  index.SetSharedTier(b, true);
  const std::int32_t c = index.AddEngine();
  const std::int32_t a = Apply(index, RouterIndex::kNewEngine,
                               {S(Slice(h, 0, 5), 1), S(Slice(h, 0, 5), 0, 8), S(Slice(h, 0, 5), 1, std::nullopt, "SHARED_STORAGE"),
                                S(Slice(h, 0, 5), 0, 8, "SHARED_STORAGE")});
  EXPECT_TRUE(index.ReadsSharedTier(a));
  EXPECT_FALSE(index.ReadsSharedTier(c));
  EXPECT_EQ(Scores(index, prompt), (std::vector<std::int64_t>{20, 0, 20}));
  ASSERT_EQ(index.NumSharedBlocks().size(), 2U);
  EXPECT_EQ(index.NumSharedBlocks()[0].blocks, 5);
  EXPECT_EQ(index.NumSharedBlocks()[1].window, std::optional<std::uint64_t>(8));
  Apply(index, b, {S(Slice(h, 0, 2), 1), S(Slice(h, 0, 2), 0, 8)});
  Apply(index, a, {R({h[2]}, 0, "SHARED_STORAGE")});
  EXPECT_EQ(Scores(index, prompt)[0], 20);
  EXPECT_EQ(Scores(index, Prompt(17))[0], 8);
  Apply(index, a, {S({h[2]}, 0, 8, "SHARED_STORAGE")});  // the window's block 2 is back
  EXPECT_EQ(index.RemoveSharedBlocks({RouterHash{h[3], RouterHash::kUnsigned, {}}, RouterHash{h[3], RouterHash::kUnsigned, {}}},
                                     std::nullopt),
            1);
  EXPECT_EQ(Scores(index, prompt)[0], 12);
  index.ClearSharedTier();
  EXPECT_EQ(Scores(index, prompt)[0], 8);
  EXPECT_TRUE(index.NumSharedBlocks().empty());
}

TEST(RouterIndex, AMalformedBatchChangesNothing) {
  const auto prompt = Prompt(9);
  const auto h = Hashes(prompt);
  RouterIndex index;
  const std::int32_t e = Apply(index, RouterIndex::kNewEngine, {S(h)});
  const std::string good = Batch({Cleared(), S({12345})});
  auto expect_refused = [&](const std::string& payload, const std::string& message) {
    try {
      index.ApplyMsgpack(e, payload.data(), payload.size());
      ADD_FAILURE() << "accepted: " << message;
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find(message), std::string::npos) << err.what();
    }
    EXPECT_EQ(Scores(index, prompt), std::vector<std::int64_t>{8});
    EXPECT_EQ(index.NumBlocks(e), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 2}}));
    EXPECT_EQ(index.Engines(), std::vector<std::int32_t>{e});
  };
  // A wrong field after a good clear: the clear is not applied either.
  {
    Mp m;
    m.Array(3).Float(1.0).Array(2).Map(1).Str("type").Str("AllBlocksCleared");
    m.Map(4).Str("type").Str("BlockStored").Str("block_hashes").Array(1).UInt(1);
    m.Str("block_size").UInt(4).Str("medium").Array(1).Str("GPU");
    m.Nil();
    expect_refused(m.out, "event 1 (BlockStored): medium must be a str or None, got ['GPU']");
  }
  {
    Mp m;
    m.Array(3).Float(1.0).Array(2).Map(1).Str("type").Str("AllBlocksCleared");
    m.Map(4).Str("type").Str("BlockStored").Str("block_hashes").Array(2).UInt(1).Bool(true);
    m.Str("block_size").UInt(4).Str("medium").Nil();
    m.Nil();
    expect_refused(m.out, "event 1 (BlockStored): block_hashes must be a list of ints or bytes");
  }
  {
    Mp m;
    m.Array(3).Float(1.0).Array(2).Map(1).Str("type").Str("AllBlocksCleared");
    m.Map(4).Str("type").Str("BlockStored").Str("block_hashes").Array(0).Str("block_size").UInt(4);
    m.Str("lora_id").Float(std::nan(""));
    m.Nil();
    expect_refused(m.out, "event 1 (BlockStored): lora_id must be an int or None, got nan");
  }
  {
    Mp m;
    m.Array(3).Float(1.0).Array(2).Map(1).Str("type").Str("AllBlocksCleared");
    m.Array(2).Array(1).Str("BlockStored").Array(0);
    m.Nil();
    expect_refused(m.out, "event 1: unknown KV event [['BlockStored'], []]");
  }
  {
    Mp m;
    m.Array(3).Float(1.0).Array(1).Map(1).Str("type").Str("Bogus");
    m.Nil();
    expect_refused(m.out, "event 0: unknown KV event type 'Bogus'");
  }
  {
    Mp m;
    m.Array(3).Float(1.0).Array(1).Map(2).Str("type").Str("BlockRemoved").Str("group_idx").Int(-1);
    m.Nil();
    expect_refused(m.out, "event 0 (BlockRemoved): block_hashes must be a list of ints or bytes, got None");
  }
  expect_refused(good.substr(0, good.size() - 3), "not a msgpack KVEventBatch: input data was truncated");
  expect_refused(good + "x", "not a msgpack KVEventBatch: trailing characters");
  expect_refused(std::string("\xc1", 1), "not a msgpack KVEventBatch: invalid byte 0xc1");
  expect_refused(Mp{}.Map(0).out, "not a KVEventBatch [ts, events, rank]: {}");
  {
    Mp m;
    for (int k = 0; k < 100; ++k) m.Array(1);
    m.Nil();
    expect_refused(m.out, "nested deeper than");
  }
  // A refused batch from an engine not registered yet registers nothing.
  const std::string bogus = Mp{}.Array(2).Float(1.0).Array(1).UInt(7).out;
  EXPECT_THROW(index.ApplyMsgpack(RouterIndex::kNewEngine, bogus.data(), bogus.size()), std::invalid_argument);
  EXPECT_EQ(index.Engines(), std::vector<std::int32_t>{e});
  // And the good one applies whole.
  index.ApplyMsgpack(e, good.data(), good.size());
  EXPECT_EQ(Scores(index, prompt), std::vector<std::int64_t>{0});
  EXPECT_EQ(index.NumBlocks(e), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 1}}));
}

TEST(RouterIndex, BytesAndOtherHashesAreKeysOfTheirOwnAndReleasedWithTheirEntries) {
  RouterIndex index;
  Mp m;
  m.Array(3).Float(1.0).Array(1).Map(4).Str("type").Str("BlockStored");
  m.Str("block_hashes").Array(4).Bin("ab").Bin("ab").Int(-5).UInt(5);
  m.Str("block_size").UInt(4).Str("medium").Str("GPU");
  m.Nil();
  const std::int32_t e = index.ApplyMsgpack(RouterIndex::kNewEngine, m.out.data(), m.out.size());
  EXPECT_EQ(index.NumBlocks(e), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 3}}));
  EXPECT_EQ(index.NumInterned(), 1U);
  RouterEvent removed;
  removed.type = RouterEvent::kRemoved;
  removed.hashes.push_back(RouterHash{0, RouterHash::kOpaque, "bab"});
  removed.hashes.push_back(RouterHash{0, RouterHash::kOpaque, "bnever"});
  index.ApplyEvents(e, {removed});
  EXPECT_EQ(index.NumBlocks(e), (std::vector<std::pair<std::uint64_t, std::int64_t>>{{0, 2}}));
  EXPECT_EQ(index.NumInterned(), 0U);
  EXPECT_EQ(index.NumEntries(), 2U);
}

TEST(RouterIndex, ThreeHundredEnginesInOneLookup) {
  const auto prompt = Prompt(41);  // 10 blocks
  const auto h = Hashes(prompt);
  RouterIndex index;
  std::vector<std::int64_t> want;
  for (std::size_t e = 0; e < 300; ++e) {
    const std::size_t held = e % 11;  // blocks 0 .. held-1, and the last one (never reached)
    std::vector<std::uint64_t> blocks = Slice(h, 0, held);
    blocks.push_back(h[9]);
    Apply(index, RouterIndex::kNewEngine, {S(blocks)});
    want.push_back(static_cast<std::int64_t>(held == 10 ? 40 : (held == 9 ? 40 : held * 4)));
  }
  EXPECT_EQ(Scores(index, prompt), want);
  for (std::int32_t s = 0; s < 300; s += 2) index.RemoveEngine(s);
  std::vector<std::int64_t> odd;
  for (std::size_t e = 1; e < 300; e += 2) odd.push_back(want[e]);
  EXPECT_EQ(Scores(index, prompt), odd);
}

TEST(RouterIndex, DamagedPayloadsAreRefusedOrAppliedNeverMisread) {
  // Every truncation and many one-byte changes of a valid batch: each either throws
  // std::invalid_argument (and changes nothing) or applies; the sanitizers watch the reads.
  const auto prompt = Prompt(41);
  const auto h = Hashes(prompt);
  const std::string good = Batch({S(Slice(h, 0, 6)), S(Slice(h, 2, 8), 1, 8), R({h[1]}), Cleared(), S(h, 0)});
  std::uint64_t seed = 35;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  int refused = 0, applied = 0;
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    RouterIndex index;
    EXPECT_THROW(index.ApplyMsgpack(RouterIndex::kNewEngine, good.data(), cut), std::invalid_argument);
    EXPECT_TRUE(index.Engines().empty());
  }
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(next() % 3);
    for (int k = 0; k < flips; ++k) bad[next() % bad.size()] = static_cast<char>(next() & 0xff);
    RouterIndex index;
    bool ok = true;
    try {
      index.ApplyMsgpack(RouterIndex::kNewEngine, bad.data(), bad.size());
    } catch (const std::invalid_argument&) {
      ok = false;
    }
    if (!ok) {
      ++refused;
      EXPECT_TRUE(index.Engines().empty());
      EXPECT_EQ(index.NumEntries(), 0U);
      continue;
    }
    ++applied;
    try {
      (void)Scores(index, prompt);
    } catch (const std::invalid_argument&) {  // e.g. a block size that became two
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(applied, 0);
}

}  // namespace
}  // namespace kvcache
