#include "kvcache/reuse_tree.h"

#include <algorithm>
#include <cstring>

#include "kvcache/errors.h"

namespace kvcache {

ReuseTree::ReuseTree(std::int32_t num_windows) : num_windows_(num_windows) {
  KVC_CHECK(num_windows > 0, "a reuse tree needs at least one window");
  nodes_.emplace_back();
  nodes_[kRoot].in_use = true;
  blocks_.assign(static_cast<std::size_t>(num_windows_), kNullBlock);
}

bool ReuseTree::KeyEquals(NodeId node, const TokenId* tokens, std::int32_t n,
                          std::uint64_t extras) const {
  const Node& nd = nodes_[node];
  return nd.extras == extras && static_cast<std::int32_t>(nd.tokens.size()) == n &&
         (n == 0 || std::memcmp(nd.tokens.data(), tokens, sizeof(TokenId) * static_cast<std::size_t>(n)) == 0);
}

NodeId ReuseTree::FindChild(NodeId parent, std::uint64_t hash, const TokenId* tokens,
                            std::int32_t n, std::uint64_t extras) const {
  auto it = index_.find(hash);
  if (it == index_.end()) return kNoNode;
  const NodeId c = it->second;
  if (nodes_[c].parent != parent || !KeyEquals(c, tokens, n, extras)) return kNoNode;
  return c;
}

NodeId ReuseTree::GetOrCreateChild(NodeId parent, std::uint64_t hash, const TokenId* tokens,
                                   std::int32_t n, std::uint64_t extras, bool has_multimodal) {
  auto it = index_.find(hash);
  if (it != index_.end()) {
    const NodeId c = it->second;
    return (nodes_[c].parent == parent && KeyEquals(c, tokens, n, extras)) ? c : kNoNode;
  }
  NodeId id;
  if (!free_nodes_.empty()) {
    id = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    id = static_cast<NodeId>(nodes_.size());
    nodes_.emplace_back();
    blocks_.resize(blocks_.size() + static_cast<std::size_t>(num_windows_), kNullBlock);
  }
  Node& nd = nodes_[id];
  nd.parent = parent;
  nd.depth = nodes_[parent].depth + 1;
  nd.in_use = true;
  nd.has_multimodal = has_multimodal;
  nd.hash = hash;
  nd.extras = extras;
  nd.tokens.assign(tokens, tokens + n);
  nd.first_child = kNoNode;
  nd.prev_sibling = kNoNode;
  nd.next_sibling = nodes_[parent].first_child;
  if (nd.next_sibling != kNoNode) nodes_[nd.next_sibling].prev_sibling = id;
  nodes_[parent].first_child = id;
  std::fill_n(blocks_.begin() + static_cast<std::ptrdiff_t>(Slot(id, 0)), num_windows_, kNullBlock);
  index_.emplace(hash, id);
  return id;
}

bool ReuseTree::IsEmpty(NodeId node) const {
  const auto first = blocks_.begin() + static_cast<std::ptrdiff_t>(Slot(node, 0));
  return std::all_of(first, first + num_windows_, [](BlockId b) { return b == kNullBlock; });
}

void ReuseTree::Delete(NodeId node) {
  Node& nd = nodes_[node];
  if (nd.prev_sibling != kNoNode) {
    nodes_[nd.prev_sibling].next_sibling = nd.next_sibling;
  } else {
    nodes_[nd.parent].first_child = nd.next_sibling;
  }
  if (nd.next_sibling != kNoNode) nodes_[nd.next_sibling].prev_sibling = nd.prev_sibling;
  index_.erase(nd.hash);
  // The token buffer keeps its capacity for the next node made from this slot: creating and
  // deleting nodes (every store of a new prompt, every eviction) then allocates nothing.
  std::vector<TokenId> tokens = std::move(nd.tokens);
  tokens.clear();
  nd = Node{};
  nd.tokens = std::move(tokens);
  free_nodes_.push_back(node);
}

void ReuseTree::PruneUp(NodeId node) {
  while (node != kRoot && node != kNoNode && IsLeaf(node) && IsEmpty(node)) {
    const NodeId parent = nodes_[node].parent;
    Delete(node);
    node = parent;
  }
}

void ReuseTree::CheckInvariants() const {
  std::size_t linked = 0;
  std::vector<NodeId> stack = {kRoot};
  while (!stack.empty()) {
    const NodeId n = stack.back();
    stack.pop_back();
    ++linked;
    KVC_CHECK(nodes_[n].in_use, detail::Concat("deleted node ", n, " is linked into the tree"));
    NodeId prev = kNoNode;
    for (NodeId c = nodes_[n].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      KVC_CHECK(nodes_[c].parent == n, detail::Concat("node ", c, " has a wrong parent"));
      KVC_CHECK(nodes_[c].prev_sibling == prev, detail::Concat("node ", c, " has a wrong sibling link"));
      KVC_CHECK(nodes_[c].depth == nodes_[n].depth + 1, detail::Concat("node ", c, " has a wrong depth"));
      auto it = index_.find(nodes_[c].hash);
      KVC_CHECK(it != index_.end() && it->second == c, detail::Concat("node ", c, " is missing from the index"));
      KVC_CHECK(!IsLeaf(c) || !IsEmpty(c), detail::Concat("leaf node ", c, " holds no block"));
      prev = c;
      stack.push_back(c);
    }
  }
  KVC_CHECK(linked == NumNodes(), detail::Concat(NumNodes(), " nodes in use but ", linked, " reachable"));
  KVC_CHECK(index_.size() + 1 == linked, "hash index size does not match the tree");
}

}  // namespace kvcache
