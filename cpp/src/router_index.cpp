#include "kvcache/router_index.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>

namespace kvcache {
namespace {

inline std::uint64_t Mix(std::uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  return x;
}

inline int Popcount(std::uint64_t x) { return __builtin_popcountll(x); }

std::string LoraRangeError(std::uint64_t bits) {
  return "lora_task_id = " + std::to_string(bits) + " is out of range [" + std::to_string(INT64_MIN) + ", " +
         std::to_string(INT64_MAX) + "]";
}

}  // namespace

// ---- Entry ---------------------------------------------------------------------------------

std::size_t RouterIndex::KeyHash::operator()(const Key& k) const noexcept {
  return static_cast<std::size_t>(Mix(k.value + 0x9E3779B97F4A7C15ULL * (k.space * 4 + k.kind + 1)));
}

std::size_t RouterIndex::Entry::Rank(std::int32_t slot) const {
  const auto s = static_cast<std::uint32_t>(slot);
  std::size_t r = 0;
  for (std::uint32_t w = 0; w < s / 64; ++w) r += static_cast<std::size_t>(Popcount(data[w]));
  const std::uint64_t below = (s % 64) == 0 ? 0 : (data[s / 64] & ((std::uint64_t{1} << (s % 64)) - 1));
  return r + static_cast<std::size_t>(Popcount(below));
}

bool RouterIndex::Entry::Add(std::int32_t slot, std::uint64_t media) {
  const auto s = static_cast<std::uint32_t>(slot);
  if (s / 64 >= nwords) {
    const std::uint32_t grow = s / 64 + 1 - nwords;
    data.insert(data.begin() + nwords, grow, 0);
    nwords += grow;
  }
  if (Has(slot)) {
    Media(slot) |= media;
    return false;
  }
  const std::size_t r = Rank(slot);
  data[s / 64] |= std::uint64_t{1} << (s % 64);
  data.insert(data.begin() + static_cast<std::ptrdiff_t>(nwords + r), media);
  return true;
}

bool RouterIndex::Entry::Erase(std::int32_t slot) {
  const auto s = static_cast<std::uint32_t>(slot);
  const std::size_t r = Rank(slot);
  data.erase(data.begin() + static_cast<std::ptrdiff_t>(nwords + r));
  data[s / 64] &= ~(std::uint64_t{1} << (s % 64));
  return data.size() == nwords;
}

// ---- Engines and the store -----------------------------------------------------------------

RouterIndex::RouterIndex(bool shared_tier) : shared_default_(shared_tier) {}

RouterIndex::Engine& RouterIndex::Live(std::int32_t slot) {
  const RouterIndex& self = *this;
  self.Live(slot);
  return engines_[slot];
}

const RouterIndex::Engine& RouterIndex::Live(std::int32_t slot) const {
  if (slot < 0 || static_cast<std::size_t>(slot) >= engines_.size() || !engines_[slot].live) {
    throw std::out_of_range("no engine in slot " + std::to_string(slot));
  }
  return engines_[slot];
}

std::int32_t RouterIndex::AddEngine() {
  std::unique_lock lock(mu_);
  return AddEngineLocked();
}

std::int32_t RouterIndex::AddEngineLocked() {
  std::size_t slot = 0;
  while (slot < engines_.size() && engines_[slot].live) ++slot;
  if (slot == engines_.size()) {
    if (slot >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      throw std::length_error("too many engines");
    }
    engines_.emplace_back();
  }
  engines_[slot] = Engine{};
  engines_[slot].live = true;
  order_.push_back(static_cast<std::int32_t>(slot));
  return static_cast<std::int32_t>(slot);
}

void RouterIndex::SetSharedTier(std::int32_t slot, std::optional<bool> shared_tier) {
  std::unique_lock lock(mu_);
  Engine& engine = Live(slot);
  if (shared_tier.has_value()) engine.shared_tier = shared_tier;
}

bool RouterIndex::ReadsShared(const Engine& engine) const { return engine.shared_tier.value_or(shared_default_); }

bool RouterIndex::ReadsSharedTier(std::int32_t slot) const {
  std::shared_lock lock(mu_);
  return ReadsShared(Live(slot));
}

void RouterIndex::RemoveEngine(std::int32_t slot) {
  std::unique_lock lock(mu_);
  Engine& engine = Live(slot);
  std::int64_t held = 0;
  for (const Group& g : engine.groups) held += g.blocks;
  if (held > 0) {
    for (auto it = table_.begin(); it != table_.end();) {
      if (it->second.Has(slot) && it->second.Erase(slot)) {
        const Key key = it->first;
        it = table_.erase(it);
        Release(key);
      } else {
        ++it;
      }
    }
  }
  engine = Engine{};
  order_.erase(std::find(order_.begin(), order_.end(), slot));
}

std::vector<std::int32_t> RouterIndex::Engines() const {
  std::shared_lock lock(mu_);
  return order_;
}

std::vector<std::pair<std::uint64_t, std::int64_t>> RouterIndex::NumBlocks(std::int32_t slot) const {
  std::shared_lock lock(mu_);
  std::vector<std::pair<std::uint64_t, std::int64_t>> out;
  for (const Group& g : Live(slot).groups) out.emplace_back(g.idx, g.blocks);
  return out;
}

std::vector<RouterSharedCount> RouterIndex::NumSharedBlocks() const {
  std::shared_lock lock(mu_);
  std::vector<RouterSharedCount> out;
  for (const SharedSet& s : shared_sets_) {
    if (s.blocks > 0) out.push_back({s.block_size, s.window, s.blocks});
  }
  return out;
}

std::int64_t RouterIndex::RemoveSharedBlocks(const std::vector<RouterHash>& hashes,
                                             std::optional<std::uint64_t> window) {
  std::unique_lock lock(mu_);
  std::unordered_set<Key, KeyHash> gone;
  for (const RouterHash& h : hashes) {
    Key key{};
    if (ToKey(h, 0, false, &key)) gone.insert(key);
  }
  std::int64_t removed = 0;
  for (std::size_t s = 0; s < shared_sets_.size(); ++s) {
    if (shared_sets_[s].window != window) continue;
    for (Key key : gone) {
      key.space = s;
      if (shared_.erase(key) > 0) {
        ++removed;
        --shared_sets_[s].blocks;
        Release(key);
      }
    }
  }
  return removed;
}

void RouterIndex::ClearSharedTier() {
  std::unique_lock lock(mu_);
  for (const Key& key : shared_) Release(key);
  shared_.clear();
  shared_sets_.clear();
}

std::size_t RouterIndex::NumEntries() const {
  std::shared_lock lock(mu_);
  return table_.size();
}

std::size_t RouterIndex::NumInterned() const {
  std::shared_lock lock(mu_);
  return interned_.size();
}

bool RouterIndex::ToKey(const RouterHash& h, std::uint64_t space, bool intern, Key* key) {
  key->space = space;
  key->kind = h.kind;
  if (h.kind != RouterHash::kOpaque) {
    key->value = h.value;
    return true;
  }
  auto it = interned_.find(h.opaque);
  if (it == interned_.end()) {
    if (!intern) return false;
    it = interned_.emplace(h.opaque, Interned{next_interned_++, 0}).first;
    interned_names_.emplace(it->second.id, h.opaque);
  }
  if (intern) ++it->second.refs;
  key->value = it->second.id;
  return true;
}

void RouterIndex::Release(const Key& key) {
  if (key.kind != RouterHash::kOpaque) return;
  const auto name = interned_names_.find(key.value);
  const auto it = interned_.find(name->second);
  if (--it->second.refs == 0) {
    interned_.erase(it);
    interned_names_.erase(name);
  }
}

std::uint64_t RouterIndex::MediumId(const std::optional<std::string>& medium) {
  if (!medium.has_value()) return 0;
  for (std::size_t k = 0; k < media_.size(); ++k) {
    if (media_[k] == *medium) return k + 1;
  }
  media_.push_back(*medium);  // the caller checked there is room
  return media_.size();
}

std::optional<std::size_t> RouterIndex::FindSharedSet(std::uint64_t block_size,
                                                      const std::optional<std::uint64_t>& window) const {
  for (std::size_t s = 0; s < shared_sets_.size(); ++s) {
    if (shared_sets_[s].block_size == block_size && shared_sets_[s].window == window) return s;
  }
  return std::nullopt;
}

RouterIndex::Group* RouterIndex::FindGroup(Engine& engine, std::uint64_t idx) {
  for (Group& g : engine.groups) {
    if (g.idx == idx) return &g;
  }
  return nullptr;
}

// ---- Events --------------------------------------------------------------------------------

std::int32_t RouterIndex::ApplyMsgpack(std::int32_t slot, const char* data, std::size_t size) {
  const std::vector<RouterEvent> events = DecodeRouterEventBatch(data, size);  // no lock: nothing shared yet
  return ApplyEvents(slot, events);
}

std::int32_t RouterIndex::ApplyEvents(std::int32_t slot, const std::vector<RouterEvent>& events) {
  std::unique_lock lock(mu_);
  return ApplyLocked(slot, events);
}

std::int32_t RouterIndex::ApplyLocked(std::int32_t slot, const std::vector<RouterEvent>& events) {
  if (slot != kNewEngine) Live(slot);
  // The one check that needs the index: room for every medium the batch names.
  std::vector<std::string> fresh;
  for (std::size_t k = 0; k < events.size(); ++k) {
    const RouterEvent& e = events[k];
    if (e.type != RouterEvent::kStored || !e.medium.has_value() || *e.medium == kSharedStorage) continue;
    if (std::find(media_.begin(), media_.end(), *e.medium) != media_.end()) continue;
    if (std::find(fresh.begin(), fresh.end(), *e.medium) != fresh.end()) continue;
    fresh.push_back(*e.medium);
    if (media_.size() + fresh.size() > static_cast<std::size_t>(kMaxMedia)) {
      throw std::invalid_argument("event " + std::to_string(k) + " (BlockStored): medium must be one of at most " +
                                  std::to_string(kMaxMedia) + " distinct names, got a new one '" + *e.medium + "'");
    }
  }
  if (slot == kNewEngine) slot = AddEngineLocked();
  for (const RouterEvent& e : events) ApplyOne(slot, e);
  return slot;
}

void RouterIndex::ApplyOne(std::int32_t slot, const RouterEvent& e) {
  Engine& engine = engines_[slot];
  if (e.type == RouterEvent::kCleared) {
    std::int64_t held = 0;
    for (const Group& g : engine.groups) held += g.blocks;
    if (held == 0) return;
    for (auto it = table_.begin(); it != table_.end();) {
      if (it->second.Has(slot) && it->second.Erase(slot)) {
        const Key key = it->first;
        it = table_.erase(it);
        Release(key);
      } else {
        ++it;
      }
    }
    for (Group& g : engine.groups) g.blocks = 0;
    return;
  }
  if (e.medium.has_value() && *e.medium == kSharedStorage) {
    ApplyShared(slot, e);
    return;
  }
  if (e.type == RouterEvent::kStored) {
    Group* group = FindGroup(engine, e.group_idx);
    if (group == nullptr) {
      engine.groups.push_back(Group{});
      group = &engine.groups.back();
      group->idx = e.group_idx;
    }
    const bool sliding = e.spec_kind == "sliding_window";
    group->block_size = e.block_size;
    group->window = sliding ? std::optional<std::uint64_t>(e.sliding_window) : std::nullopt;
    group->recurrent = e.spec_kind == "mamba";
    const std::uint64_t media = std::uint64_t{1} << MediumId(e.medium);
    for (const RouterHash& h : e.hashes) {
      Key key{};
      ToKey(h, e.group_idx, true, &key);
      auto [it, created] = table_.try_emplace(key);
      if (!created) Release(key);  // the entry holds its reference already
      if (it->second.Add(slot, media)) ++group->blocks;
    }
    if (e.lora_name.has_value() && e.has_lora_id) {
      engine.lora_ids[*e.lora_name] = LoraId{e.lora_id_unsigned, e.lora_id};
    }
    return;
  }
  Group* group = FindGroup(engine, e.group_idx);
  if (group == nullptr) return;
  std::optional<std::uint64_t> bit;  // a medium the index never heard of is held nowhere
  if (e.medium.has_value()) {
    for (std::size_t k = 0; k < media_.size(); ++k) {
      if (media_[k] == *e.medium) bit = std::uint64_t{1} << (k + 1);
    }
  }
  for (const RouterHash& h : e.hashes) {
    Key key{};
    if (!ToKey(h, e.group_idx, false, &key)) continue;
    const auto it = table_.find(key);
    if (it == table_.end() || !it->second.Has(slot)) continue;
    if (e.medium.has_value()) {
      std::uint64_t& mask = it->second.Media(slot);
      if (bit.has_value()) mask &= ~*bit;
      if (mask != 0) continue;
    }
    --group->blocks;
    if (it->second.Erase(slot)) {
      table_.erase(it);
      Release(key);
    }
  }
}

void RouterIndex::ApplyShared(std::int32_t slot, const RouterEvent& e) {
  Engine& engine = engines_[slot];
  if (e.type == RouterEvent::kStored) {
    if (!engine.shared_tier.has_value()) engine.shared_tier = true;  // it writes a store: it reads it
    const bool sliding = e.spec_kind == "sliding_window";
    const SharedSpec spec{e.block_size, sliding ? std::optional<std::uint64_t>(e.sliding_window) : std::nullopt};
    auto g = std::find_if(shared_groups_.begin(), shared_groups_.end(),
                          [&](const auto& x) { return x.first == e.group_idx; });
    if (g == shared_groups_.end()) {
      shared_groups_.emplace_back(e.group_idx, spec);
    } else {
      g->second = spec;
    }
    std::optional<std::size_t> s = FindSharedSet(spec.block_size, spec.window);
    if (!s.has_value()) {
      shared_sets_.push_back({spec.block_size, spec.window, 0});
      s = shared_sets_.size() - 1;
    }
    for (const RouterHash& h : e.hashes) {
      Key key{};
      ToKey(h, *s, true, &key);
      if (shared_.insert(key).second) {
        ++shared_sets_[*s].blocks;
      } else {
        Release(key);
      }
    }
    if (e.lora_name.has_value() && e.has_lora_id) {
      shared_lora_ids_[*e.lora_name] = LoraId{e.lora_id_unsigned, e.lora_id};
    }
    return;
  }
  const auto g = std::find_if(shared_groups_.begin(), shared_groups_.end(),
                              [&](const auto& x) { return x.first == e.group_idx; });
  if (g == shared_groups_.end()) return;
  const std::optional<std::size_t> s = FindSharedSet(g->second.block_size, g->second.window);
  if (!s.has_value()) return;
  for (const RouterHash& h : e.hashes) {
    Key key{};
    if (!ToKey(h, *s, false, &key)) continue;
    if (shared_.erase(key) > 0) {
      --shared_sets_[*s].blocks;
      Release(key);
    }
  }
}

// ---- Lookups -------------------------------------------------------------------------------

std::vector<std::int64_t> RouterIndex::Scores(const TokenId* tokens, std::size_t num_tokens,
                                              const RouterLookupKey& key,
                                              const std::vector<std::int32_t>* slots) const {
  std::shared_lock lock(mu_);
  const std::vector<std::int32_t>& names = slots != nullptr ? *slots : order_;
  for (const std::int32_t s : names) Live(s);
  std::vector<std::int64_t> out(names.size(), 0);
  if (num_tokens <= 1) return out;

  // One group of an engine as the lookup sees it.
  struct View {
    std::uint64_t idx;
    std::uint64_t block_size;
    std::optional<std::uint64_t> window;
    bool recurrent;
  };
  struct Member {
    std::size_t pos;  // in names
    std::int32_t slot;
    std::size_t first, count;  // its groups: views[first, first + count)
    bool reader;
  };
  struct Class {
    std::uint64_t block_size;
    bool has_lora;
    std::int64_t lora;
    std::vector<std::uint64_t> hashes;
    std::vector<Member> members;
  };
  std::vector<View> views;  // every engine's groups, one after the other (no allocation each)
  views.reserve(names.size() * 2);
  std::vector<Class> classes;
  for (std::size_t pos = 0; pos < names.size(); ++pos) {
    const std::int32_t slot = names[pos];
    const Engine& engine = engines_[slot];
    const bool reader = ReadsShared(engine);
    const std::size_t first = views.size();
    for (const Group& g : engine.groups) views.push_back({g.idx, g.block_size, g.window, g.recurrent});
    if (reader) {  // one store, one layout: a group the engine announced nothing in holds nothing
      for (const auto& [idx, spec] : shared_groups_) {
        const bool known = std::any_of(engine.groups.begin(), engine.groups.end(),
                                       [&](const Group& g) { return g.idx == idx; });
        if (!known) views.push_back({idx, spec.block_size, spec.window, false});
      }
    }
    const Member m{pos, slot, first, views.size() - first, reader};
    if (m.count == 0) continue;
    bool has_lora = key.lora_id.has_value();
    std::int64_t lora = key.lora_id.value_or(0);
    if (key.lora_name.has_value()) {
      const LoraId* found = nullptr;
      if (const auto it = engine.lora_ids.find(*key.lora_name); it != engine.lora_ids.end()) {
        found = &it->second;
      } else if (reader) {
        if (const auto jt = shared_lora_ids_.find(*key.lora_name); jt != shared_lora_ids_.end()) found = &jt->second;
      }
      if (found == nullptr) continue;  // a name never published matches nothing
      if (found->is_unsigned) throw std::invalid_argument(LoraRangeError(static_cast<std::uint64_t>(found->value)));
      has_lora = true;
      lora = found->value;
    }
    const std::uint64_t block_size = views[first].block_size;
    for (std::size_t k = first; k < views.size(); ++k) {
      if (views[k].block_size == block_size) continue;
      std::vector<std::uint64_t> sizes;
      for (std::size_t j = first; j < views.size(); ++j) sizes.push_back(views[j].block_size);
      std::sort(sizes.begin(), sizes.end());
      sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
      std::string list;
      for (const std::uint64_t s : sizes) list += (list.empty() ? "" : ", ") + std::to_string(s);
      throw std::invalid_argument("the engine's groups have different block sizes [" + list + "]");
    }
    auto cls = std::find_if(classes.begin(), classes.end(), [&](const Class& c) {
      return c.block_size == block_size && c.has_lora == has_lora && (!has_lora || c.lora == lora);
    });
    if (cls == classes.end()) {
      if (block_size > static_cast<std::uint64_t>(INT32_MAX)) {
        throw std::invalid_argument("tokens_per_block = " + std::to_string(block_size) + " is out of range [1, " +
                                    std::to_string(INT32_MAX) + "]");
      }
      Class c{block_size, has_lora, lora, {}, {}};
      ReuseExtras extras;
      if (has_lora) extras.lora_task_id = lora;
      extras.cache_salt = key.cache_salt;
      extras.multimodal = key.multimodal;
      const std::size_t keyed = num_tokens - 1;  // the last token is always computed
      const std::size_t full = keyed - keyed % block_size;
      ChainHashes(tokens, full, static_cast<std::int32_t>(block_size), extras, &c.hashes);
      classes.push_back(std::move(c));
      cls = classes.end() - 1;
    }
    cls->members.push_back(m);
  }
  struct Groups {  // one member's views
    const View* b;
    const View* e;
    const View* begin() const { return b; }
    const View* end() const { return e; }
  };
  auto groups_of = [&views](const Member& m) { return Groups{views.data() + m.first, views.data() + m.first + m.count}; };

  for (Class& cls : classes) {
    const std::vector<std::uint64_t>& hashes = cls.hashes;
    const std::size_t n = hashes.size();
    const std::int64_t bsize = static_cast<std::int64_t>(cls.block_size);
    // The class's distinct groups, which members hold them as full attention (a bitset over
    // slots) and the members whose rule needs more than full attention's.
    std::vector<std::uint64_t> gidx;
    std::int32_t max_slot = 0;
    for (const Member& m : cls.members) {
      max_slot = std::max(max_slot, m.slot);
      for (const View& v : groups_of(m)) {
        if (std::find(gidx.begin(), gidx.end(), v.idx) == gidx.end()) gidx.push_back(v.idx);
      }
    }
    const std::size_t words = static_cast<std::size_t>(max_slot) / 64 + 1;
    std::vector<std::vector<std::uint64_t>> fa(gidx.size());
    std::vector<bool> fa_any(gidx.size(), false);
    std::vector<std::uint64_t> alive(words, 0);
    struct Complex {
      const Member* m;
      std::vector<std::pair<std::size_t, std::uint64_t>> sliding;  // group (in gidx), window blocks
      std::vector<std::size_t> states;                             // recurrent groups (in gidx)
      std::vector<std::int64_t> last_gap;
      std::int64_t best = 0;
    };
    std::vector<Complex> complex;
    std::vector<std::int64_t> limit(static_cast<std::size_t>(max_slot) + 1, 0);
    std::vector<std::int64_t> complex_of(static_cast<std::size_t>(max_slot) + 1, -1);
    for (const Member& m : cls.members) {
      const auto s = static_cast<std::uint32_t>(m.slot);
      alive[s / 64] |= std::uint64_t{1} << (s % 64);
      Complex cx{&m, {}, {}, {}, 0};
      for (const View& v : groups_of(m)) {
        const std::size_t k = static_cast<std::size_t>(std::find(gidx.begin(), gidx.end(), v.idx) - gidx.begin());
        if (v.recurrent) {
          cx.states.push_back(k);
        } else if (v.window.has_value()) {
          cx.sliding.emplace_back(k, *v.window / cls.block_size + (*v.window % cls.block_size != 0 ? 1 : 0));
        } else {
          if (fa[k].empty()) fa[k].assign(words, 0);
          fa[k][s / 64] |= std::uint64_t{1} << (s % 64);
          fa_any[k] = true;
        }
      }
      if (!cx.sliding.empty() || !cx.states.empty()) {
        if (complex_of[s] < 0) {
          cx.last_gap.assign(cx.sliding.size(), -1);
          complex_of[s] = static_cast<std::int64_t>(complex.size());
          complex.push_back(std::move(cx));
        }
      }
    }
    // The walk: block i for every engine still matching; an engine stops at the first block a
    // full-attention group of it lacks, the walk when none is left.
    std::vector<const Entry*> found(gidx.size(), nullptr);
    std::vector<std::uint64_t> next(words);
    std::size_t i = 0;
    for (; i < n; ++i) {
      bool any = false;
      for (const std::uint64_t w : alive) any = any || w != 0;
      if (!any) break;
      for (std::size_t k = 0; k < gidx.size(); ++k) {
        const auto it = table_.find(Key{gidx[k], hashes[i], RouterHash::kUnsigned});
        found[k] = it == table_.end() ? nullptr : &it->second;
      }
      next = alive;
      for (std::size_t k = 0; k < gidx.size(); ++k) {
        if (!fa_any[k]) continue;
        for (std::size_t w = 0; w < words; ++w) {
          const std::uint64_t held = found[k] == nullptr ? 0 : found[k]->Word(static_cast<std::uint32_t>(w));
          next[w] &= ~(fa[k][w] & ~held);
        }
      }
      for (std::size_t w = 0; w < words; ++w) {
        std::uint64_t dead = alive[w] & ~next[w];
        while (dead != 0) {
          const int b = __builtin_ctzll(dead);
          dead &= dead - 1;
          limit[w * 64 + static_cast<std::size_t>(b)] = static_cast<std::int64_t>(i);
        }
      }
      alive.swap(next);
      for (Complex& cx : complex) {
        const auto s = static_cast<std::uint32_t>(cx.m->slot);
        if (((alive[s / 64] >> (s % 64)) & 1U) == 0) continue;
        bool served = true;
        for (std::size_t j = 0; j < cx.sliding.size(); ++j) {
          const auto [k, window_blocks] = cx.sliding[j];
          if (found[k] == nullptr || !found[k]->Has(cx.m->slot)) cx.last_gap[j] = static_cast<std::int64_t>(i);
          const std::uint64_t from = i + 1 > window_blocks ? i + 1 - window_blocks : 0;
          if (cx.last_gap[j] >= static_cast<std::int64_t>(from)) served = false;
        }
        for (const std::size_t k : cx.states) {
          if (found[k] == nullptr || !found[k]->Has(cx.m->slot)) served = false;
        }
        if (served) cx.best = static_cast<std::int64_t>(i) + 1;
      }
    }
    for (std::size_t w = 0; w < words; ++w) {
      std::uint64_t rest = alive[w];
      while (rest != 0) {
        const int b = __builtin_ctzll(rest);
        rest &= rest - 1;
        limit[w * 64 + static_cast<std::size_t>(b)] = static_cast<std::int64_t>(i);
      }
    }
    // Past the local hit: the store's blocks (the core's SharedServed).
    std::vector<std::vector<std::int8_t>> memo(shared_sets_.size());
    auto in_store = [&](std::optional<std::size_t> set, std::size_t d) {
      if (!set.has_value()) return false;
      std::vector<std::int8_t>& m = memo[*set];
      if (m.empty()) m.assign(n, -1);
      if (m[d] < 0) m[d] = shared_.count(Key{*set, hashes[d], RouterHash::kUnsigned}) > 0 ? 1 : 0;
      return m[d] == 1;
    };
    for (const Member& m : cls.members) {
      const auto s = static_cast<std::size_t>(m.slot);
      const std::int64_t base = complex_of[s] >= 0 ? complex[static_cast<std::size_t>(complex_of[s])].best : limit[s];
      std::int64_t best = base;
      if (m.reader && base < static_cast<std::int64_t>(n)) {
        struct StoreGroup {
          std::optional<std::size_t> set;
          std::optional<std::uint64_t> window;
          std::int64_t last_gap;
        };
        std::vector<StoreGroup> store;
        for (const View& v : groups_of(m)) store.push_back({FindSharedSet(cls.block_size, v.window), v.window, base - 1});
        for (std::int64_t h = base + 1; h <= static_cast<std::int64_t>(n); ++h) {
          bool served = true;
          bool stop = false;
          for (StoreGroup& g : store) {
            if (!in_store(g.set, static_cast<std::size_t>(h - 1))) {
              g.last_gap = h - 1;
              if (!g.window.has_value()) stop = true;  // full attention never recovers
            }
            std::int64_t front = 0;
            if (g.window.has_value()) {
              const auto reach = static_cast<std::uint64_t>(h * bsize);
              front = reach > *g.window ? static_cast<std::int64_t>(reach - *g.window) : 0;
            }
            if (g.last_gap >= std::max(base, front / bsize)) served = false;
          }
          if (stop) break;
          if (served) best = h;
        }
      }
      out[m.pos] = best * bsize;
    }
  }
  return out;
}

}  // namespace kvcache
