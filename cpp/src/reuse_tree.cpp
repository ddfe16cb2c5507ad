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
  const NodeId c = index_.Find(hash);
  if (c == kNoNode || nodes_[c].parent != parent || !KeyEquals(c, tokens, n, extras)) return kNoNode;
  return c;
}

NodeId ReuseTree::GetOrCreateChild(NodeId parent, std::uint64_t hash, const TokenId* tokens,
                                   std::int32_t n, std::uint64_t extras, bool has_multimodal) {
  if (const NodeId c = index_.Find(hash); c != kNoNode) {
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
  nd.first_token = n > 0 ? tokens[0] : -1;
  nd.first_child = kNoNode;
  nd.prev_sibling = kNoNode;
  nd.next_sibling = nodes_[parent].first_child;
  if (nd.next_sibling != kNoNode) nodes_[nd.next_sibling].prev_sibling = id;
  nodes_[parent].first_child = id;
  std::fill_n(blocks_.begin() + static_cast<std::ptrdiff_t>(Slot(id, 0)), num_windows_, kNullBlock);
  index_.Insert(hash, id);
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
  index_.Erase(nd.hash);
  // The token buffer keeps its capacity for the next node made from this slot: creating and
  // deleting nodes (every store of a new prompt, every eviction) then allocates nothing.
  std::vector<TokenId> tokens = std::move(nd.tokens);
  tokens.clear();
  nd = Node{};
  nd.tokens = std::move(tokens);
  free_nodes_.push_back(node);
}

void ReuseTree::NodeIndex::Insert(std::uint64_t hash, NodeId node) {
  if ((size_ + 1) * 2 > slots_.size()) {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    --shift_;
    size_ = 0;
    for (const Slot& e : old) {
      if (e.node != kNoNode) Insert(e.hash, e.node);
    }
  }
  std::size_t i = Home(hash);
  while (slots_[i].node != kNoNode) {
    KVC_DCHECK(slots_[i].hash != hash, "hash index: duplicate insert");
    i = (i + 1) & Mask();
  }
  slots_[i] = Slot{hash, node};
  ++size_;
}

void ReuseTree::NodeIndex::Erase(std::uint64_t hash) {
  std::size_t i = Home(hash);
  while (slots_[i].hash != hash || slots_[i].node == kNoNode) {
    KVC_CHECK(slots_[i].node != kNoNode, "hash index: erase of a missing hash");
    i = (i + 1) & Mask();
  }
  // Backward shift: move up every later entry of the run that may not sit after the hole.
  for (std::size_t j = (i + 1) & Mask(); slots_[j].node != kNoNode; j = (j + 1) & Mask()) {
    const std::size_t home = Home(slots_[j].hash);
    // Entry j stays where it is if its home lies cyclically in (i, j].
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    slots_[i] = slots_[j];
    i = j;
  }
  slots_[i] = Slot{};
  --size_;
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
      KVC_CHECK(nodes_[c].first_token == (nodes_[c].tokens.empty() ? -1 : nodes_[c].tokens[0]),
                detail::Concat("node ", c, " has a wrong first token"));
      KVC_CHECK(index_.Find(nodes_[c].hash) == c, detail::Concat("node ", c, " is missing from the index"));
      KVC_CHECK(!IsLeaf(c) || !IsEmpty(c), detail::Concat("leaf node ", c, " holds no block"));
      prev = c;
      stack.push_back(c);
    }
  }
  KVC_CHECK(linked == NumNodes(), detail::Concat(NumNodes(), " nodes in use but ", linked, " reachable"));
  KVC_CHECK(index_.size() + 1 == linked, "hash index size does not match the tree");
}

}  // namespace kvcache
