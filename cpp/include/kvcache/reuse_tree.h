// Prefix tree of block keys shared by all windows, with one block slot per window per node.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

using NodeId = std::int32_t;
inline constexpr NodeId kNoNode = -1;

/// Radix tree whose edges are block keys: node d of a chain stands for the tokens
/// [d * tpb, (d + 1) * tpb) of every prompt with that prefix (the last node of a chain may hold
/// fewer tokens). Each node holds, per window, the block that caches that position in that
/// window, or kNullBlock (a *placeholder*: the chain continues, this window's block is gone).
///
/// Children are found in O(1) through one hash index keyed by the chained 64-bit hash (which
/// covers the whole prefix), verified against the stored tokens and extras digest, so a hash
/// collision can never return a wrong block. The tree never owns KV memory; it holds BlockIds.
/// Not thread-safe; the owning manager serializes access.
class ReuseTree {
 public:
  explicit ReuseTree(std::int32_t num_windows);

  static constexpr NodeId kRoot = 0;

  /// The child of `parent` with chained hash `hash` whose key equals (tokens[0..n), extras),
  /// or kNoNode.
  NodeId FindChild(NodeId parent, std::uint64_t hash, const TokenId* tokens, std::int32_t n,
                   std::uint64_t extras) const;
  /// FindChild, creating the child (with no blocks) when it does not exist. Returns kNoNode
  /// only when another key already owns `hash` (a 64-bit collision): the caller stops storing.
  NodeId GetOrCreateChild(NodeId parent, std::uint64_t hash, const TokenId* tokens,
                          std::int32_t n, std::uint64_t extras, bool has_multimodal);

  BlockId Block(NodeId node, std::int32_t window_index) const {
    return blocks_[Slot(node, window_index)];
  }
  void SetBlock(NodeId node, std::int32_t window_index, BlockId block) {
    blocks_[Slot(node, window_index)] = block;
  }
  /// True if `node` is a live node of the tree (not deleted).
  bool Alive(NodeId node) const {
    return node >= 0 && static_cast<std::size_t>(node) < nodes_.size() && nodes_[node].in_use;
  }
  /// True if no window holds a block at `node`.
  bool IsEmpty(NodeId node) const;
  bool IsLeaf(NodeId node) const { return nodes_[node].first_child == kNoNode; }
  NodeId Parent(NodeId node) const { return nodes_[node].parent; }
  std::uint64_t Hash(NodeId node) const { return nodes_[node].hash; }
  std::uint64_t Extras(NodeId node) const { return nodes_[node].extras; }
  bool HasMultimodal(NodeId node) const { return nodes_[node].has_multimodal; }
  std::int32_t NumTokens(NodeId node) const {
    return static_cast<std::int32_t>(nodes_[node].tokens.size());
  }
  const TokenId* Tokens(NodeId node) const { return nodes_[node].tokens.data(); }
  /// The first key token of `node`, or -1 if its key has none (read without touching the
  /// token buffer: a scan over many children compares this first).
  TokenId FirstToken(NodeId node) const { return nodes_[node].first_token; }
  /// Depth of `node` (root = 0, its children = 1, ...).
  std::int32_t Depth(NodeId node) const { return nodes_[node].depth; }
  /// Nodes in use, the root included.
  std::size_t NumNodes() const { return nodes_.size() - free_nodes_.size(); }

  /// Deletes `node` and then each ancestor while it holds no block and has no children.
  void PruneUp(NodeId node);

  template <typename F>
  void ForEachChild(NodeId parent, F&& visit) const {
    for (NodeId c = nodes_[parent].first_child; c != kNoNode; c = nodes_[c].next_sibling) visit(c);
  }
  /// Visits every node below `node` (not `node` itself), parents before children.
  template <typename F>
  void ForEachDescendant(NodeId node, F&& visit) const {
    std::vector<NodeId> stack;
    ForEachChild(node, [&](NodeId c) { stack.push_back(c); });
    while (!stack.empty()) {
      const NodeId n = stack.back();
      stack.pop_back();
      visit(n);
      ForEachChild(n, [&](NodeId c) { stack.push_back(c); });
    }
  }

  /// Verifies parent/child links, depths, the hash index and that no deleted node is linked.
  /// Throws InternalError naming the first violation.
  void CheckInvariants() const;

 private:
  struct Node {
    NodeId parent = kNoNode;
    NodeId first_child = kNoNode;
    NodeId next_sibling = kNoNode;
    NodeId prev_sibling = kNoNode;
    std::int32_t depth = 0;
    TokenId first_token = -1;  // tokens[0], or -1 when tokens is empty
    bool in_use = false;
    bool has_multimodal = false;
    std::uint64_t hash = 0;
    std::uint64_t extras = 0;
    std::vector<TokenId> tokens;
  };

  std::size_t Slot(NodeId node, std::int32_t w) const {
    return static_cast<std::size_t>(node) * static_cast<std::size_t>(num_windows_) +
           static_cast<std::size_t>(w);
  }
  bool KeyEquals(NodeId node, const TokenId* tokens, std::int32_t n, std::uint64_t extras) const;
  void Delete(NodeId node);

  std::int32_t num_windows_;
  std::vector<Node> nodes_;
  std::vector<BlockId> blocks_;  // [node][window]
  std::vector<NodeId> free_nodes_;
  /// Chained hash -> node: open addressing with linear probing in a power-of-two table at
  /// most half full, backward-shift deletion. Inserting and erasing allocate nothing (unless
  /// the table grows), and a lookup is a multiply, a shift and usually one probe.
  class NodeIndex {
   public:
    NodeIndex() : slots_(kInitialSlots) {}
    /// The node with `hash`, or kNoNode.
    NodeId Find(std::uint64_t hash) const {
      for (std::size_t i = Home(hash);; i = (i + 1) & Mask()) {
        if (slots_[i].node == kNoNode) return kNoNode;
        if (slots_[i].hash == hash) return slots_[i].node;
      }
    }
    /// Adds `hash` -> `node`; `hash` must be absent.
    void Insert(std::uint64_t hash, NodeId node);
    /// Removes `hash`, which must be present.
    void Erase(std::uint64_t hash);
    std::size_t size() const { return size_; }

   private:
    struct Slot {
      std::uint64_t hash = 0;
      NodeId node = kNoNode;  // kNoNode: empty
    };
    static constexpr std::size_t kInitialSlots = 64;
    std::size_t Mask() const { return slots_.size() - 1; }
    /// Fibonacci hashing: the top bits of hash * 2^64 / phi.
    std::size_t Home(std::uint64_t hash) const {
      return static_cast<std::size_t>((hash * 0x9E3779B97F4A7C15ULL) >> shift_);
    }
    std::vector<Slot> slots_;
    std::size_t size_ = 0;
    int shift_ = 58;  // 64 - log2(slots_.size())
  };
  NodeIndex index_;
};

}  // namespace kvcache
