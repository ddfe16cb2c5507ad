// KVCacheManager, pool layout: the pools of every window (layers of one shape share a pool),
// the layer -> pool table, and the engine's views of the pools and of one layer.
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {
namespace {

/// The pool key of a layer: layers of one window with equal keys share a pool. Ordered, so a
/// window's pools are sorted by KV-head count, then head size, then dtype.
using PoolKey = std::tuple<std::int32_t, std::int32_t, DType>;

PoolKey LayerPoolKey(const ModelSpec& model, std::int32_t l) {
  const auto i = static_cast<std::size_t>(l);
  const std::int32_t heads = model.num_kv_heads.size() == 1 ? model.num_kv_heads[0] : model.num_kv_heads[i];
  const std::int32_t head_dim = model.head_dims.empty() ? model.head_dim : model.head_dims[i];
  const DType dtype = model.dtypes.empty() ? model.dtype : model.dtypes[i];
  return {heads, head_dim, dtype};
}

}  // namespace

std::vector<std::vector<PoolLayout>> KVCacheManager::PlanPools(const ModelSpec& model,
                                                               const std::vector<WindowSize>& layer_window) {
  layer_to_pool_.assign(static_cast<std::size_t>(model.num_layers), {-1, -1});
  std::int32_t global_pool = 0;
  std::vector<std::vector<PoolLayout>> window_pools(window_sizes_.size());
  for (std::size_t w = 0; w < window_sizes_.size(); ++w) {
    const WindowSize window = window_sizes_[w];
    std::map<PoolKey, PoolLayout> by_shape;  // ascending (heads, head size, dtype)
    for (std::int32_t l = 0; l < model.num_layers; ++l) {
      if (layer_window[l] != window) continue;
      const PoolKey key = LayerPoolKey(model, l);
      PoolLayout& pool = by_shape[key];
      pool.num_kv_heads = std::get<0>(key);
      pool.layers.push_back(l);
      pool.kv_factor = model.kv_factor;
      pool.tokens_per_block = tpb_;
      pool.head_dim = std::get<1>(key);
      pool.dtype = std::get<2>(key);
      pool.elem_bytes = DTypeBytes(pool.dtype);
    }
    for (auto& kv : by_shape) {
      const auto pool_in_window = window_pools[w].size();
      for (std::size_t i = 0; i < kv.second.layers.size(); ++i) {
        layer_to_pool_[kv.second.layers[i]] = {global_pool, static_cast<std::int32_t>(i)};
      }
      pool_index_.emplace_back(w, pool_in_window);
      ++global_pool;
      window_pools[w].push_back(std::move(kv.second));
    }
  }
  return window_pools;
}

std::vector<PoolInfo> KVCacheManager::pools() const {
  std::vector<PoolInfo> out;
  for (const auto& [w, p] : pool_index_) {
    const WindowBlockManager& wm = *windows_[w];
    const PoolLayout& layout = wm.pools()[p];
    PoolInfo info;
    info.window = wm.window();
    info.num_kv_heads = layout.num_kv_heads;
    info.layers = layout.layers;
    info.kv_factor = layout.kv_factor;
    info.head_dim = layout.head_dim;
    info.dtype = layout.dtype;
    info.block_bytes = layout.BlockBytes();
    info.block_stride = wm.primary_stride(p);
    info.num_primary = wm.num_primary();
    info.num_secondary = wm.num_secondary();
    info.primary_ptr = reinterpret_cast<std::uintptr_t>(wm.primary_base(p));
    info.secondary_ptr = reinterpret_cast<std::uintptr_t>(wm.secondary_base(p));
    out.push_back(std::move(info));
  }
  return out;
}

LayerView KVCacheManager::GetLayerView(std::int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer < 0 || layer >= static_cast<std::int32_t>(layer_to_pool_.size())) {
    ThrowInvalid("layer_idx ", layer, " is out of range [0, ", layer_to_pool_.size(), ")");
  }
  if (!backend_->HasMemory()) throw KVCacheError("the virtual backend has no KV memory to view");
  const auto [g, idx] = layer_to_pool_[static_cast<std::size_t>(layer)];
  const auto [w, p] = pool_index_[static_cast<std::size_t>(g)];
  const WindowBlockManager& wm = *windows_[w];
  const PoolLayout& pool = wm.pools()[p];
  const std::int64_t elem = pool.elem_bytes;
  const auto slab = static_cast<std::int64_t>(pool.SlabBytes());
  LayerView view;
  view.data = static_cast<unsigned char*>(wm.primary_base(p)) + static_cast<std::int64_t>(idx) * kv_factor_ * slab;
  view.dtype = pool.dtype;
  view.shape = {wm.num_primary(), kv_factor_, pool.num_kv_heads, tpb_, pool.head_dim};
  view.strides = {static_cast<std::int64_t>(wm.primary_stride(p)), slab,
                  static_cast<std::int64_t>(tpb_) * pool.head_dim * elem, pool.head_dim * elem, elem};
  view.backend = backend_->Kind();
  return view;
}

}  // namespace kvcache
