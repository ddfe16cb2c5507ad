#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "args.h"
#include "bind_router.h"
#include "bindings.h"
#include "kvcache/block_key.h"
#include "kvcache/memory_backend.h"
#include "kvcache/shared_tier.h"
#include "kvcache/types.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvcache native core: VSWA block pools, sliding windows and memory backends";
  kvcache::py::BindErrors(m);  // first: the exception hierarchy
  m.attr("NULL_BLOCK") = kvcache::kNullBlock;
  m.attr("OFFSET_SENTINEL") = kvcache::kOffsetSentinel;
  m.attr("DEFAULT_PRIORITY") = kvcache::kDefaultPriority;
  m.def("cuda_compiled", &kvcache::CudaCompiled, "True if the CUDA backend was compiled in.");
  m.def("cuda_available", &kvcache::CudaAvailable,
        "True if the CUDA backend was compiled in and a CUDA device is usable now.");
  m.def("cuda_mem_get_info", &kvcache::CudaMemGetInfo,
        "(free, total) bytes of the current CUDA device; raises CudaError without one.");
  m.def(
      "_block_hashes",
      [](const pybind11::handle& tokens, const kvcache::py::TokensPerBlock& tokens_per_block,
         const std::optional<kvcache::py::LoraTaskId>& lora_task_id,
         const std::optional<kvcache::py::CacheSalt>& cache_salt,
         const std::vector<kvcache::py::MultimodalArg>& multimodal) {
        const std::vector<kvcache::TokenId> toks = kvcache::py::ToTokens(tokens, "tokens");
        const kvcache::ReuseExtras extras = kvcache::py::MakeExtras(lora_task_id, cache_salt, multimodal);
        const std::size_t full = toks.size() - toks.size() % static_cast<std::size_t>(tokens_per_block.value);
        std::vector<std::uint64_t> out;
        kvcache::ChainHashes(toks.data(), full, tokens_per_block.value, extras, &out);
        return out;
      },
      pybind11::arg("tokens"), pybind11::arg("tokens_per_block"), pybind11::arg("lora_task_id") = pybind11::none(),
      pybind11::arg("cache_salt") = pybind11::none(),
      pybind11::arg("multimodal") = std::vector<kvcache::py::MultimodalArg>{},
      "Chained block keys of the full blocks of `tokens` (the core's ChainHashes).");
  m.def(
      "_check_shared_cache_url", [](const std::string& url) { kvcache::ParseRedisUrl(url); }, pybind11::arg("url"),
      "Raises ValueError unless `url` is a shared_cache_url the core connects to (the core's ParseRedisUrl).");
  m.attr("SHARED_CACHE_PASSWORD_ENV") = kvcache::kSharedCachePasswordEnv;
  kvcache::py::BindManager(m);
  kvcache::py::BindEstimates(m);
  kvcache::py::BindState(m);
  kvcache::py::BindRouter(m);
}
