// The disk tier below host memory: evicted host blocks are written to disk, onboarded on a
// hit with their bytes intact, evicted LRU when the tier is full; events name level 2.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "kvcache/secondary_tier.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

ManagerConfig DiskConfig(std::int32_t primary, std::int32_t secondary, std::int32_t disk,
                         BackendKind backend = BackendKind::kHost) {
  ManagerConfig c = Config({}, 64, {{64, primary}}, /*tpb=*/4, backend);
  c.blocks_per_window[64].secondary = secondary;
  c.disk_blocks_per_window[64] = disk;
  c.enable_block_reuse = true;
  c.event_buffer_max_size = 1000;
  return c;
}

std::int32_t Add(KVCacheManager& m, SeqId id, const std::vector<TokenId>& tokens) {
  return m.AddSequence(id, tokens.data(), tokens.size(), {});
}

/// The bytes of block `b` in every layer (each layer's K and V of that block).
std::vector<unsigned char> BlockBytes(KVCacheManager& m, BlockId b, std::int32_t layers) {
  std::vector<unsigned char> out;
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerView v = m.GetLayerView(l);
    const auto* base = static_cast<const unsigned char*>(v.data) + b * v.strides[0];
    const auto bytes = static_cast<std::size_t>(v.strides[1] * v.shape[1]);
    out.insert(out.end(), base, base + bytes);
  }
  return out;
}

void Fill(KVCacheManager& m, BlockId b, std::int32_t layers, std::mt19937* rng) {
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerView v = m.GetLayerView(l);
    auto* base = static_cast<unsigned char*>(v.data) + b * v.strides[0];
    for (std::int64_t i = 0; i < v.strides[1] * v.shape[1]; ++i) base[i] = static_cast<unsigned char>((*rng)());
  }
}

std::vector<std::pair<int, int>> LevelMoves(KVCacheManager& m) {
  std::vector<std::pair<int, int>> out;
  for (const KVCacheEvent& e : m.GetLatestEvents(0)) {
    if (e.kind == EventKind::kUpdated && e.cache_level.has_value()) out.push_back(*e.cache_level);
  }
  return out;
}

TEST(DiskTierTest, HostBlocksGoToDiskAndComeBackByteForByte) {
  constexpr std::int32_t kLayers = 2;
  KVCacheManager m(Model(kLayers, {2}, 8), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/4));
  std::mt19937 rng(1);
  const auto a = Iota(9);
  Add(m, 1, a);  // blocks 0, 1, 2
  Fill(m, 0, kLayers, &rng);
  Fill(m, 1, kLayers, &rng);
  const auto a0 = BlockBytes(m, 0, kLayers);
  const auto a1 = BlockBytes(m, 1, kLayers);
  m.RemoveSequence(1);  // caches a0 (block 0) and a1 (block 1)
  m.GetLatestEvents(0);
  // B takes block 2 (scratch), then block 1 (a1 goes to host block 3), then block 0: a0 goes
  // to the host block, so a1 moves on to disk first.
  Add(m, 2, Iota(9, 100));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{2, 1, 0}));
  EXPECT_EQ(LevelMoves(m), (std::vector<std::pair<int, int>>{{0, 1}, {1, 2}, {0, 1}}));
  for (BlockId b = 0; b < 3; ++b) Fill(m, b, kLayers, &rng);  // B overwrites every block
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  m.CheckInvariants();
  // A again: a0 is onboarded from host memory, a1 from disk, bytes intact.
  EXPECT_EQ(m.GetReusablePrefixLength(a.data(), a.size(), {}), 8);
  EXPECT_EQ(Add(m, 3, a), 8);
  EXPECT_EQ(LevelMoves(m), (std::vector<std::pair<int, int>>{{1, 0}, {2, 0}}));
  const auto got = m.GetCacheBlockIds(3, 64);
  EXPECT_EQ(BlockBytes(m, got[0], kLayers), a0);
  EXPECT_EQ(BlockBytes(m, got[1], kLayers), a1);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 2);
  EXPECT_EQ(m.GetStats().offloaded_blocks, 2);
  m.CheckInvariants();
}

TEST(DiskTierTest, FullDiskDropsItsLeastRecentlyUsedBlock) {
  KVCacheManager m(Model(1), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/1));
  // Four 1-block prompts (5 tokens: 1 cached block + 1 scratch block each). The third and the
  // fourth push the oldest ones down: prompt 0 to host memory, then on to disk for prompt 1.
  for (SeqId r = 0; r < 4; ++r) {
    Add(m, r, Iota(5, 100 * static_cast<TokenId>(r)));
    m.RemoveSequence(r);
  }
  std::vector<std::int32_t> reusable;
  for (TokenId r = 0; r < 4; ++r) {
    const auto t = Iota(5, 100 * r);
    reusable.push_back(m.GetReusablePrefixLength(t.data(), t.size(), {}));
  }
  EXPECT_EQ(reusable, (std::vector<std::int32_t>{4, 4, 4, 4}));  // GPU: 2, 3; host: 1; disk: 0
  // New content takes every primary block: prompts 2 and 3 move down, and each one that
  // reaches the full disk drops the least recently used block there (0, then 1).
  Add(m, 10, Iota(9, 1000));
  m.RemoveSequence(10, /*store_for_reuse=*/false);
  reusable.clear();
  for (TokenId r = 0; r < 4; ++r) {
    const auto t = Iota(5, 100 * r);
    reusable.push_back(m.GetReusablePrefixLength(t.data(), t.size(), {}));
  }
  EXPECT_EQ(reusable, (std::vector<std::int32_t>{0, 0, 4, 4}));  // host: 3; disk: 2
  m.CheckInvariants();
}

TEST(DiskTierTest, PartialReuseCopiesFromADiskBlock) {
  constexpr std::int32_t kLayers = 1;
  KVCacheManager m(Model(kLayers, {1}, 8), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/2));
  std::mt19937 rng(7);
  const auto a = Iota(9);
  Add(m, 1, a);
  Fill(m, 1, kLayers, &rng);
  const auto a1 = BlockBytes(m, 1, kLayers);
  m.RemoveSequence(1);
  Add(m, 2, Iota(9, 100));  // a1 ends on disk, a0 in host memory (as above)
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  // Tokens 0..5 then others: block 0 whole (onboard), block 1's first 2 tokens copied from disk.
  std::vector<TokenId> b = Iota(6);
  b.push_back(500);
  b.push_back(501);
  b.push_back(502);
  EXPECT_EQ(Add(m, 3, b), 6);
  const auto got = m.GetCacheBlockIds(3, 64);
  const auto have = BlockBytes(m, got[1], kLayers);
  // Layer view of one block: [kv, heads, tokens, head_dim] float16: 2 tokens = 32 bytes per row.
  const LayerView v = m.GetLayerView(0);
  const auto token_bytes = static_cast<std::size_t>(v.strides[3]);
  const auto row = static_cast<std::size_t>(v.strides[1]);  // K to V
  for (std::size_t k = 0; k < 2; ++k) {  // K and V (one head)
    for (std::size_t i = 0; i < 2 * token_bytes; ++i) EXPECT_EQ(have[k * row + i], a1[k * row + i]);
  }
  m.CheckInvariants();
}

TEST(DiskTierTest, VirtualBackendKeepsTheBookkeeping) {
  KVCacheManager m(Model(1), DiskConfig(3, 1, 2, BackendKind::kVirtual));
  Add(m, 1, Iota(9));
  m.RemoveSequence(1);
  Add(m, 2, Iota(9, 100));
  m.RemoveSequence(2, false);
  EXPECT_EQ(Add(m, 3, Iota(9)), 8);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 2);
  m.CheckInvariants();
}

TEST(DiskTierTest, BadCountsAreRefused) {
  ManagerConfig c = DiskConfig(3, 0, 2);
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);  // no host pool
  c = DiskConfig(3, 1, -1);
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);
  c = DiskConfig(3, 1, 1);
  c.disk_blocks_per_window[32] = 1;
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);  // not a window
}

/// A fresh directory under $TMPDIR (or /tmp), removed with its contents at the end of scope.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvcache-test-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  /// The names in the directory, sorted.
  std::vector<std::string> Names() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  /// The one file whose name ends in `suffix`.
  std::string File(const std::string& suffix) const {
    std::string found;
    for (const std::string& name : Names()) {
      if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        EXPECT_TRUE(found.empty()) << "two files end in " << suffix;
        found = path_ + "/" + name;
      }
    }
    EXPECT_FALSE(found.empty()) << "no file ends in " << suffix;
    return found;
  }

 private:
  std::string path_;
};

/// XORs the byte at `offset` of file `path` with 0xff.
void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0xff));
}

std::vector<TierSegment> Segments(std::vector<unsigned char>* bytes, std::size_t split) {
  return {{bytes->data(), split}, {bytes->data() + split, bytes->size() - split}};
}

TEST(DiskTierTest, TierVerifiesKeyHashAndChecksumOnEveryRead) {
  TempDir dir;
  const std::shared_ptr<SecondaryTier> tier = MakeDiskTier(dir.path());
  // One lock file at once, named by a 16-hex-digit instance id; window files on first write.
  const std::vector<std::string> names = dir.Names();
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0].size(), std::string("kvcache-0123456789abcdef.lock").size()) << names[0];
  std::vector<unsigned char> block(100);
  for (std::size_t i = 0; i < block.size(); ++i) block[i] = static_cast<unsigned char>(i + 1);
  const TierKey k0{64, 0, 0x1111};
  const TierKey k1{64, 1, 0x2222};
  std::vector<unsigned char> other(block.rbegin(), block.rend());
  ASSERT_TRUE(tier->Put(k0, Segments(&block, 30)));
  ASSERT_TRUE(tier->Put(k1, Segments(&other, 30)));
  const std::string file = dir.File("-window-64.kvblocks");
  EXPECT_EQ(std::filesystem::file_size(file), 2 * (kDiskSlotHeader + 100));
  std::vector<unsigned char> got(100);
  ASSERT_TRUE(tier->Get(k1, Segments(&got, 30)));
  EXPECT_EQ(got, other);
  ASSERT_TRUE(tier->Get(k0, Segments(&got, 30)));
  EXPECT_EQ(got, block);
  // Another key's hash for the slot, another size, a window never written: refused.
  EXPECT_FALSE(tier->Get(TierKey{64, 0, 0x2222}, Segments(&got, 30)));
  std::vector<unsigned char> shorter(99);
  EXPECT_FALSE(tier->Get(k0, Segments(&shorter, 30)));
  EXPECT_FALSE(tier->Get(TierKey{128, 0, 0x1111}, Segments(&got, 30)));
  // One flipped bit of the content, of the header's hash: refused; the other slot still reads.
  FlipByte(file, static_cast<std::streamoff>(kDiskSlotHeader + 57));
  EXPECT_FALSE(tier->Get(k0, Segments(&got, 30)));
  FlipByte(file, static_cast<std::streamoff>(kDiskSlotHeader + 57));
  ASSERT_TRUE(tier->Get(k0, Segments(&got, 30)));
  FlipByte(file, static_cast<std::streamoff>(kDiskSlotHeader + 100 + 8));  // slot 1's key hash
  EXPECT_FALSE(tier->Get(k1, Segments(&got, 30)));
  ASSERT_TRUE(tier->Get(k0, Segments(&got, 30)));
  // Truncated (a short read), then extended with zeros: refused, never zeros served.
  std::filesystem::resize_file(file, kDiskSlotHeader + 50);
  EXPECT_FALSE(tier->Get(k0, Segments(&got, 30)));
  std::filesystem::resize_file(file, 2 * (kDiskSlotHeader + 100));
  EXPECT_FALSE(tier->Get(k0, Segments(&got, 30)));
  // A Put again makes the slot readable again.
  ASSERT_TRUE(tier->Put(k0, Segments(&block, 30)));
  ASSERT_TRUE(tier->Get(k0, Segments(&got, 30)));
  EXPECT_EQ(got, block);
}

TEST(DiskTierTest, TwoTiersInOneDirectoryShareNoFileAndCleanUp) {
  TempDir dir;
  {
    const std::shared_ptr<SecondaryTier> a = MakeDiskTier(dir.path());
    const std::shared_ptr<SecondaryTier> b = MakeDiskTier(dir.path());
    std::vector<unsigned char> x(64, 0xaa);
    std::vector<unsigned char> y(64, 0x55);
    ASSERT_TRUE(a->Put(TierKey{64, 0, 7}, Segments(&x, 8)));
    ASSERT_TRUE(b->Put(TierKey{64, 0, 7}, Segments(&y, 8)));  // same window, slot and hash
    EXPECT_EQ(dir.Names().size(), 4u);                        // two lock files, two window files
    std::vector<unsigned char> got(64);
    ASSERT_TRUE(a->Get(TierKey{64, 0, 7}, Segments(&got, 8)));
    EXPECT_EQ(got, x);
    ASSERT_TRUE(b->Get(TierKey{64, 0, 7}, Segments(&got, 8)));
    EXPECT_EQ(got, y);
  }
  EXPECT_TRUE(dir.Names().empty());
}

TEST(DiskTierTest, AnUnusableDirectoryIsRefusedWithTheSystemsReason) {
  TempDir dir;
  const std::string file = dir.path() + "/plain";
  std::ofstream(file) << "x";
  try {
    MakeDiskTier(file + "/tier");
    FAIL() << "a directory under a regular file was accepted";
  } catch (const KVCacheError& e) {
    EXPECT_NE(std::string(e.what()).find("Not a directory"), std::string::npos) << e.what();
  }
  try {
    MakeDiskTier(file);
    FAIL() << "a regular file was accepted as the directory";
  } catch (const KVCacheError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a directory"), std::string::npos) << e.what();
  }
  ManagerConfig c = DiskConfig(3, 1, 4);
  c.disk_cache_dir = file + "/tier";
  EXPECT_THROW(KVCacheManager(Model(1), c), KVCacheError);
}

/// The manager of the byte test above with its tier in `dir`: blocks a0 (in host memory) and
/// a1 (on disk) of prompt Iota(9) hold random bytes (returned in *a0, *a1).
KVCacheManager* SpillA(const TempDir& dir, std::int32_t layers, std::vector<unsigned char>* a0,
                       std::vector<unsigned char>* a1) {
  ManagerConfig c = DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/4);
  c.disk_cache_dir = dir.path();
  auto* m = new KVCacheManager(Model(layers, {2}, 8), c);
  std::mt19937 rng(3);
  Add(*m, 1, Iota(9));
  Fill(*m, 0, layers, &rng);
  Fill(*m, 1, layers, &rng);
  *a0 = BlockBytes(*m, 0, layers);
  *a1 = BlockBytes(*m, 1, layers);
  m->RemoveSequence(1);
  Add(*m, 2, Iota(9, 100));
  for (BlockId b = 0; b < 3; ++b) Fill(*m, b, layers, &rng);
  m->RemoveSequence(2, /*store_for_reuse=*/false);
  m->GetLatestEvents(0);
  return m;
}

TEST(DiskTierTest, AFailedOnboardReadIsAMissFromThatBlockOn) {
  constexpr std::int32_t kLayers = 2;
  TempDir dir;
  std::vector<unsigned char> a0, a1;
  const std::unique_ptr<KVCacheManager> m(SpillA(dir, kLayers, &a0, &a1));
  const std::string file = dir.File(".kvblocks");
  std::filesystem::resize_file(file, 0);  // the repro: the tier's file truncated
  const auto a = Iota(9);
  EXPECT_EQ(m->GetReusablePrefixLength(a.data(), a.size(), {}), 8);  // the lookup cannot know
  // a0 comes back from host memory; a1's read fails: dropped, and block 1 is a miss.
  EXPECT_EQ(Add(*m, 3, a), 4);
  const auto got = m->GetCacheBlockIds(3, 64);
  ASSERT_EQ(got.size(), 3u);
  for (const BlockId b : got) EXPECT_TRUE(b >= 0 && b < 3) << b;
  EXPECT_EQ(BlockBytes(*m, got[0], kLayers), a0);
  const std::vector<KVCacheEvent> events = m->GetLatestEvents(0);
  std::vector<std::pair<int, int>> moves;
  std::size_t removed = 0;
  for (const KVCacheEvent& e : events) {
    if (e.kind == EventKind::kUpdated && e.cache_level.has_value()) moves.push_back(*e.cache_level);
    removed += e.kind == EventKind::kRemoved ? 1 : 0;
  }
  EXPECT_EQ(moves, (std::vector<std::pair<int, int>>{{1, 0}}));  // a1 never reached a primary block
  EXPECT_EQ(removed, 1u);                                          // a1 left the cache
  const KvCacheStats stats = m->GetStats();
  EXPECT_EQ(stats.disk_read_failures, 1);
  EXPECT_EQ(stats.reused_blocks, 1);
  EXPECT_EQ(stats.missed_blocks, 3 + 3 + 2);  // prompts 1 and 2 missed wholly; this one its last 2 blocks
  m->CheckInvariants();
  m->RemoveSequence(3);
  m->CheckInvariants();
  EXPECT_EQ(m->GetStats().used_num_blocks, 0);
  // The prompt again: both blocks from primary memory now (a1 recomputed by "the engine").
  EXPECT_EQ(Add(*m, 4, a), 8);
  EXPECT_EQ(m->GetStats().disk_read_failures, 1);
  m->CheckInvariants();
}

TEST(DiskTierTest, AFailedPartialCopyReadIsAMissToo) {
  constexpr std::int32_t kLayers = 1;
  TempDir dir;
  std::vector<unsigned char> a0, a1;
  const std::unique_ptr<KVCacheManager> m(SpillA(dir, kLayers, &a0, &a1));
  FlipByte(dir.File(".kvblocks"), static_cast<std::streamoff>(kDiskSlotHeader + 3));  // a1's bytes
  std::vector<TokenId> b = Iota(6);  // block 0 whole, block 1's first 2 tokens from a1 on disk
  b.insert(b.end(), {500, 501, 502});
  EXPECT_EQ(Add(*m, 3, b), 4);
  const auto got = m->GetCacheBlockIds(3, 64);
  for (const BlockId blk : got) EXPECT_TRUE(blk >= 0 && blk < 3) << blk;
  EXPECT_EQ(BlockBytes(*m, got[0], kLayers), a0);
  EXPECT_EQ(m->GetStats().disk_read_failures, 1);
  m->CheckInvariants();
  m->RemoveSequence(3);
  m->CheckInvariants();
  EXPECT_EQ(m->GetStats().used_num_blocks, 0);
}

TEST(DiskTierTest, AFailedReadInOneWindowUndoesTheRoundInEveryWindow) {
  // Windows 32 and 64 (one layer each) both spill prompt A's block 1 to disk. Window 32 is
  // handed out first and onboards it; window 64's copy is corrupt: the round is undone in
  // both windows, and the request is admitted with block 0 reused in both.
  TempDir dir;
  ManagerConfig c = Config({32, 0}, 64, {{32, 3}, {64, 3}}, /*tpb=*/4);
  for (const WindowSize w : {32, 64}) {
    c.blocks_per_window[w].secondary = 1;
    c.disk_blocks_per_window[w] = 4;
  }
  c.enable_block_reuse = true;
  c.event_buffer_max_size = 1000;
  c.disk_cache_dir = dir.path();
  KVCacheManager m(Model(2), c);
  const auto a = Iota(9);
  Add(m, 1, a);
  m.RemoveSequence(1);
  Add(m, 2, Iota(9, 100));
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  FlipByte(dir.File("-window-64.kvblocks"), static_cast<std::streamoff>(kDiskSlotHeader + 3));
  EXPECT_EQ(Add(m, 3, a), 4);
  for (const WindowSize w : {32, 64}) {
    for (const BlockId b : m.GetCacheBlockIds(3, w)) EXPECT_TRUE(b >= 0 && b < 3) << w << ": " << b;
  }
  const KvCacheStats stats = m.GetStats();
  EXPECT_EQ(stats.disk_read_failures, 1);
  // Counted once, for the round that stood: 1 block reused and 2 missed per window.
  EXPECT_EQ(stats.reused_blocks_per_window_size, (std::map<WindowSize, std::int64_t>{{32, 1}, {64, 1}}));
  EXPECT_EQ(stats.missed_blocks_per_window_size, (std::map<WindowSize, std::int64_t>{{32, 8}, {64, 8}}));
  // The undone round's onboards stand (a0 and a1 in window 32, a0 in window 64); the next shares them.
  EXPECT_EQ(stats.onboarded_blocks, 2 + 1);
  m.CheckInvariants();
  m.RemoveSequence(3);
  m.CheckInvariants();
  EXPECT_EQ(m.GetStats().used_num_blocks, 0);
  EXPECT_EQ(Add(m, 4, a), 8);  // window 32 kept its onboarded block 1; window 64 recomputed its
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache
