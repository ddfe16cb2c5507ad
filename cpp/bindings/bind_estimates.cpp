// A scheduler's estimates (KVCacheManager::Get*Needs / Get*Remaining*, kv_cache_manager_estimates.cpp)
// and the pure block arithmetic of block_math.h (module-level functions of kvcache._core).
#include "init_guard.h"  // first: the guarded type casters must precede every use

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "args.h"
#include "bindings.h"
#include "kvcache/block_math.h"
#include "kvcache/capacity_scheduler.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {
namespace {

namespace bm = block_math;
using M = KVCacheManager;
namespace py = pybind11;

inline constexpr char kFinalTokens[] = "final_tokens";
inline constexpr char kChunk[] = "chunk_size";
inline constexpr char kPromptLen[] = "prompt_len";
inline constexpr char kForkTokens[] = "fork_tokens";
inline constexpr char kLo[] = "lo";
inline constexpr char kHi[] = "hi";
inline constexpr char kKeep[] = "keep";
inline constexpr char kFront[] = "front";
inline constexpr char kWindow[] = "window";
using FinalTokens = Int<std::int32_t, kFinalTokens, 1>;
using ChunkArg = Int<std::int32_t, kChunk, 1>;
using PromptLen = Int<std::int32_t, kPromptLen, 1>;
using ForkTokens = Int<std::int32_t, kForkTokens, 1>;
using TokenCount = Int<std::int64_t, kLo, 1>;
using HiCount = Int<std::int64_t, kHi, 1>;
using KeepArg = Int<std::int64_t, kKeep, 1>;
using FrontArg = Int<std::int32_t, kFront, 0>;
using WindowArg = Int<std::int64_t, kWindow, 1>;
using BlockSize = Int<std::int32_t, kTokensPerBlock, 1>;

/// Token counts (each >= 0) from a sequence of ints.
void ToLengths(const py::handle& obj, std::vector<std::int32_t>* out) {
  out->clear();
  for (const py::handle item : obj) out->push_back(Int<std::int32_t, kNumTokens, 0>::Read(item));
}

std::int32_t ChunkOrWhole(const std::optional<ChunkArg>& chunk) { return chunk.has_value() ? chunk->value : 0; }

/// Equal-length id and count lists (lists, tuples or 1-D integer arrays).
void IdsAndCounts(const py::handle& ids_obj, const py::handle& counts_obj, const char* ids_name,
                  const char* counts_name, std::vector<SeqId>* ids, std::vector<std::int32_t>* counts) {
  ToRequestIds(ids_obj, ids_name, ids);
  ToChunkSizes(counts_obj, counts_name, counts);
  if (ids->size() != counts->size()) {
    ThrowInvalid(ids->size(), " ", ids_name, " but ", counts->size(), " ", counts_name, ": they must pair up");
  }
}

void BindBlockMath(py::module_& m) {
  // Module-level functions: the block arithmetic of one sequence in one window (block_math.h).
  py::module_& sub = m;
  sub.attr("KEEP_ALL") = bm::kKeepAll;
  sub.def("window_keep", [](WindowArg window, Int<std::int64_t, kMaxDraftTokens, 0> drafts, Int<std::int64_t, kMaxSeqLen, 1> max_seq_len) {
            return bm::Keep(window.value, drafts.value, max_seq_len.value);
          },
          py::arg("window"), py::arg("max_draft_tokens"), py::arg("max_seq_len"),
          "Tokens a window keeps behind a sequence's end (window + drafts), KEEP_ALL if it never releases.");
  sub.def("released_blocks", [](Int<std::int64_t, kNumTokens, 0> n, KeepArg keep, BlockSize tpb) {
            return bm::Released(n.value, keep.value, tpb.value);
          },
          py::arg("num_tokens"), py::arg("keep"), py::arg("tokens_per_block"),
          "Leading block positions released once a sequence reached num_tokens tokens.");
  sub.def("peak_live_blocks", [](TokenCount lo, HiCount hi, KeepArg keep, BlockSize tpb, FrontArg front) {
            if (hi.value < lo.value) ThrowInvalid("hi (", hi.value, ") must be >= lo (", lo.value, ")");
            return bm::PeakLiveBlocks(lo.value, hi.value, keep.value, tpb.value, front.value);
          },
          py::arg("lo"), py::arg("hi"), py::arg("keep"), py::arg("tokens_per_block"), py::arg("front") = FrontArg{0},
          "Most blocks one sequence holds while it grows from lo to hi tokens.");
  sub.def("prefill_peak", [](Int<std::int64_t, kLo, 0> start, HiCount end, ChunkArg chunk, KeepArg keep, BlockSize tpb, FrontArg front) {
            if (end.value <= start.value) ThrowInvalid("end (", end.value, ") must be > start (", start.value, ")");
            return bm::PrefillPeak(start.value, end.value, chunk.value, keep.value, tpb.value, front.value);
          },
          py::arg("start"), py::arg("end"), py::arg("chunk_size"), py::arg("keep"), py::arg("tokens_per_block"),
          py::arg("front") = FrontArg{0},
          "Most blocks held after any prefill chunk of at most chunk_size tokens between start and end tokens.");
  sub.def("demand_blocks",
          [](Int<std::int64_t, kMaxBatchSize, 1> n, Int<std::int64_t, kNumTokens, 1> seq_len, KeepArg keep,
             Int<std::int64_t, kNumTokens, 0> budget, BlockSize tpb) {
            return bm::DemandBlocks(n.value, seq_len.value, keep.value, budget.value, tpb.value);
          },
          py::arg("n"), py::arg("seq_len"), py::arg("keep"), py::arg("budget"), py::arg("tokens_per_block"),
          "Blocks of one window that n sequences of seq_len tokens hold at most under chunked prefill with "
          "budget tokens per step.");
  sub.def("blocks_to_run_alone",
          [](PromptLen n, FinalTokens final, const std::optional<ChunkArg>& chunk, WindowArg window, KeepArg keep, BlockSize tpb) {
            return bm::BlocksToRunAlone(n.value, final.value, ChunkOrWhole(chunk), window.value, keep.value, tpb.value);
          },
          py::arg("prompt_len"), py::arg("final_tokens"), py::arg("chunk_size"), py::arg("window"), py::arg("keep"),
          py::arg("tokens_per_block"),
          "Most blocks a sequence holds in a window from registration to final_tokens tokens, nothing reused.");
}

/// The index in `all` of each of `ids`. Generation and chunk lists are subsequences of the
/// running list in its order: one forward pass finds them; anything else (paused requests,
/// newest first) falls back to a hash index.
std::vector<std::int32_t> PositionsIn(const std::vector<SeqId>& all, const std::vector<SeqId>& ids) {
  std::vector<std::int32_t> out(ids.size());
  std::size_t j = 0;
  std::size_t i = 0;
  for (; i < ids.size(); ++i, ++j) {
    while (j < all.size() && all[j] != ids[i]) ++j;
    if (j == all.size()) break;
    out[i] = static_cast<std::int32_t>(j);
  }
  if (i == ids.size()) return out;
  std::unordered_map<SeqId, std::int32_t> index;
  index.reserve(all.size());
  for (std::size_t k = 0; k < all.size(); ++k) index.emplace(all[k], static_cast<std::int32_t>(k));
  for (; i < ids.size(); ++i) out[i] = index.at(ids[i]);
  return out;
}

void BindScheduler(py::module_& m) {
  using S = CapacityScheduler;
  py::class_<S> cls(m, "CapacityScheduler", "Native capacity scheduler (see kvcache.scheduler.CapacityScheduler).");
  cls.def(py::init([](M* manager, const std::string& policy, std::int32_t max_batch_size,
                       std::optional<std::int64_t> max_num_batched_tokens, bool chunked_prefill,
                       std::optional<std::int32_t> chunk) {
             CapacitySchedulerConfig c;
             if (policy == "guaranteed_no_evict") {
               c.policy = CapacityPolicy::kGuaranteedNoEvict;
             } else if (policy == "max_utilization") {
               c.policy = CapacityPolicy::kMaxUtilization;
             } else {
               ThrowInvalid("policy must be guaranteed_no_evict or max_utilization, got '", policy, "'");
             }
             c.max_batch_size = max_batch_size;
             c.max_num_batched_tokens = max_num_batched_tokens.value_or(-1);
             c.chunked_prefill = chunked_prefill;
             c.chunk = chunk.value_or(-1);
             return std::make_unique<S>(manager, c);
           }),
           py::arg("manager"), py::arg("policy"), py::arg("max_batch_size"), py::arg("max_num_batched_tokens"),
           py::arg("chunked_prefill"), py::arg("chunk"), py::keep_alive<1, 2>())
      .def("never_fits", &S::NeverFits, py::arg("context_len"), py::arg("final_tokens"), py::arg("beams") = 0,
           "Whether a request can never run: longer than max_seq_len or beyond some window's pool (with beams "
           "more beams forked from it after its prompt).")
      .def("blocks_to_run_alone", &S::BlocksToRunAlone, py::arg("context_len"), py::arg("final_tokens"),
           py::arg("beams") = 0,
           "Per window: the most blocks such a request holds from an otherwise empty pool, its beams included.")
      .def(
          "schedule",
          [](S& self, const py::handle& running_ids, const std::optional<std::vector<std::int32_t>>& finals,
             const std::optional<std::vector<std::int32_t>>& drafts, const std::vector<SeqId>& candidate_ids,
             const std::vector<std::shared_ptr<PreparedPrompt>>& contexts,
             const std::vector<std::int32_t>& candidate_finals, const std::optional<std::vector<SeqId>>& families,
             const std::optional<std::vector<std::int32_t>>& beams,
             const std::optional<std::vector<SeqId>>& candidate_families,
             const std::optional<std::vector<std::int32_t>>& candidate_beams,
             const std::optional<std::vector<SeqId>>& waiting_families) {
            // The running ids as the per-step methods read them (a list of ints, or a 1-D array).
            thread_local std::vector<SeqId> running;
            ToRequestIds(running_ids, "running", &running);
            if ((finals && finals->size() != running.size()) || (drafts && drafts->size() != running.size())) {
              ThrowInvalid("schedule: running, final_tokens and drafts must pair up");
            }
            if (contexts.size() != candidate_ids.size() || candidate_finals.size() != candidate_ids.size()) {
              ThrowInvalid("schedule: candidate ids, contexts and final tokens must pair up");
            }
            if ((families && families->size() != running.size()) || (beams && beams->size() != running.size())) {
              ThrowInvalid("schedule: running, families and beams must pair up");
            }
            if ((candidate_families && candidate_families->size() != candidate_ids.size()) ||
                (candidate_beams && candidate_beams->size() != candidate_ids.size())) {
              ThrowInvalid("schedule: candidate ids, families and beams must pair up");
            }
            std::vector<AdmissionCandidate> candidates(candidate_ids.size());
            for (std::size_t k = 0; k < candidates.size(); ++k) {
              candidates[k] = AdmissionCandidate{candidate_ids[k], contexts[k].get(), candidate_finals[k],
                                                 candidate_families ? (*candidate_families)[k] : -1,
                                                 candidate_beams ? (*candidate_beams)[k] : 0};
            }
            RunningFamilies fams;
            if (families) fams.family = families->data();
            if (beams) fams.beams = beams->data();
            if (waiting_families) {
              if (!families) ThrowInvalid("schedule: waiting_families needs families");
              fams.waiting = waiting_families->data();
              fams.num_waiting = waiting_families->size();
            }
            StepPlan p = self.Schedule(running.data(), finals ? finals->data() : nullptr, drafts ? drafts->data() : nullptr,
                                       running.size(), candidates.data(), candidates.size(), fams);
            // Running requests by their index in `running`: the caller holds them in that order.
            auto positions = [](const std::vector<SeqId>& ids) { return PositionsIn(running, ids); };
            // The usual decode step (every running request, in order, no drafts): None for both
            // lists, so that no per-request list is built.
            const bool all_decode = p.generation == running &&
                                    std::all_of(p.drafts.begin(), p.drafts.end(), [](std::int32_t d) { return d == 0; });
            py::object generation = all_decode ? py::none() : py::cast(positions(p.generation));
            py::object drafts_out = all_decode ? py::none() : py::cast(p.drafts);
            return py::make_tuple(generation, drafts_out, positions(p.chunks), p.chunk_sizes, p.admitted,
                                  p.admitted_chunks, positions(p.paused), p.rejected);
          },
          py::arg("running"), py::arg("final_tokens"), py::arg("drafts"), py::arg("candidate_ids"),
          py::arg("contexts"), py::arg("candidate_final_tokens"), py::kw_only(), py::arg("families") = py::none(),
          py::arg("beams") = py::none(), py::arg("candidate_families") = py::none(),
          py::arg("candidate_beams") = py::none(), py::arg("waiting_families") = py::none(),
          "Plans one step: (generation, drafts, chunks, chunk sizes, admitted candidates, their first chunks, "
          "paused, rejected candidates), requests as indices into running or the candidates; generation and "
          "drafts are both None when every running request decodes, in order, without drafts. Paused requests "
          "are removed from the manager. families / candidate_families: beam family ids (< 0: none), a family "
          "decodes whole and is paused whole; beams / candidate_beams: beams still to fork from each request "
          "(guaranteed_no_evict charges their own blocks); waiting_families: families with a member waiting, which "
          "do not decode.");
  RejectSecondInit(cls);
}

}  // namespace

void BindEstimates(py::module_& m) {
  BindBlockMath(m);
  BindScheduler(m);
  py::class_<M> cls = py::reinterpret_borrow<py::class_<M>>(m.attr("KVCacheManager"));
  cls.def(
         "get_step_needs",
         [](const M& self, const py::handle& gen_ids, const py::handle& gen_tokens, const py::handle& chunk_ids,
            const py::handle& chunk_tokens) {
           thread_local std::vector<SeqId> g, c;
           thread_local std::vector<std::int32_t> gt, ct;
           IdsAndCounts(gen_ids, gen_tokens, "generation request ids", "generation token counts", &g, &gt);
           IdsAndCounts(chunk_ids, chunk_tokens, "context request ids", "chunk sizes", &c, &ct);
           return self.GetStepNeeds(g.data(), gt.data(), g.size(), c.data(), ct.data(), c.size());
         },
         py::arg("generation_ids"), py::arg("generation_tokens"), py::arg("context_ids"), py::arg("chunk_sizes"),
         "Free blocks each window (window_sizes order) must have for one engine step: the generation tokens "
         "(1 + drafts each, one add_tokens call per token position), then the prefill chunks; the step's worst "
         "point, releases credited unless another holder keeps the block.")
      .def(
          "get_sequence_step_needs",
          [](const M& self, RequestId id, NumTokens num_tokens, bool credit_releases) {
            return self.GetSequenceStepNeeds(id.value, num_tokens.value, credit_releases);
          },
          py::arg("request_id"), py::arg("num_tokens"), py::kw_only(), py::arg("credit_releases") = false,
          "Free blocks per window the next step of a registered sequence takes: num_tokens more tokens (a chunk "
          "in prefill, 0: the rest of the prompt; else the newest token plus drafts).")
      .def(
          "get_remaining_blocks",
          [](const M& self, const py::handle& ids, const py::handle& finals, const std::optional<ChunkArg>& chunk,
             bool prefill_only) {
            thread_local std::vector<SeqId> v;
            thread_local std::vector<std::int32_t> f;
            IdsAndCounts(ids, finals, "request ids", "final token counts", &v, &f);
            return self.GetRemainingBlocks(v.data(), f.data(), v.size(), ChunkOrWhole(chunk), prefill_only);
          },
          py::arg("request_ids"), py::arg("final_tokens"), py::kw_only(), py::arg("chunk_size") = py::none(),
          py::arg("prefill_only") = false,
          "Per window, summed over registered sequences: the free blocks each may still take until it holds "
          "final_tokens[i] tokens (prefill_only: until its prompt is prefilled).")
      .def(
          "get_prompt_remaining_blocks",
          [](const M& self, const PreparedPrompt& prompt, FinalTokens final, const std::optional<ChunkArg>& chunk,
             bool use_reuse, bool prefill_only) {
            return self.GetPromptRemainingBlocks(prompt, final.value, ChunkOrWhole(chunk), use_reuse, prefill_only);
          },
          py::arg("prompt"), py::arg("final_tokens"), py::kw_only(), py::arg("chunk_size") = py::none(),
          py::arg("use_reuse") = true, py::arg("prefill_only") = false,
          "Per window: the free blocks a prompt not registered yet may take until it holds final_tokens tokens.")
      .def(
          "get_prompt_step_needs",
          [](const M& self, const PreparedPrompt& prompt, const std::optional<ChunkArg>& chunk, bool credit_releases,
             bool use_reuse) {
            return self.GetPromptStepNeeds(prompt, ChunkOrWhole(chunk), credit_releases, use_reuse);
          },
          py::arg("prompt"), py::kw_only(), py::arg("chunk_size") = py::none(), py::arg("credit_releases") = false,
          py::arg("use_reuse") = true,
          "Per window: the free blocks registering the prompt with a first chunk of chunk_size tokens takes now.")
      .def(
          "get_blocks_to_run_alone",
          [](const M& self, PromptLen n, FinalTokens final, const std::optional<ChunkArg>& chunk) {
            return self.GetBlocksToRunAlone(n.value, final.value, ChunkOrWhole(chunk));
          },
          py::arg("prompt_len"), py::arg("final_tokens"), py::kw_only(), py::arg("chunk_size") = py::none(),
          "Per window: the most blocks a sequence holds from registration to final_tokens tokens, nothing reused.")
      .def(
          "get_family_remaining_blocks",
          [](const M& self, const py::handle& ids, FinalTokens final) -> std::optional<py::tuple> {
            std::vector<SeqId> v;
            ToRequestIds(ids, "request ids", &v);
            std::vector<std::int64_t> remaining, refs;
            if (!self.GetFamilyRemainingBlocks(v.data(), v.size(), final.value, &remaining, &refs)) return std::nullopt;
            return py::make_tuple(remaining, refs);
          },
          py::arg("request_ids"), py::arg("final_tokens"),
          "A beam family's free blocks to completion, its shared blocks counted once: (per window the most free "
          "blocks the registered beams request_ids take together while growing in lockstep to final_tokens "
          "tokens, per window the family's own extra holdings of shared blocks in windows that release blocks); "
          "None if the beams are not in lockstep (one in prefill, different lengths or released fronts).")
      .def(
          "get_forked_beam_blocks",
          [](const M& self, ForkTokens n, FinalTokens final) { return self.GetForkedBeamBlocks(n.value, final.value); },
          py::arg("fork_tokens"), py::arg("final_tokens"),
          "Per window: the most free blocks one more beam forked from a sequence of fork_tokens tokens takes "
          "before it holds final_tokens tokens (its copy of the shared partial block and its own new blocks).")
      .def(
          "get_num_shared_blocks", [](const M& self, WindowSizeArg w) { return self.GetNumSharedBlocks(w.value); },
          py::arg("window_size"),
          "Extra references of blocks held more than once in a window that releases blocks (0 elsewhere).")
      .def(
          "get_num_held_blocks",
          [](const M& self, RequestId id, WindowSizeArg w) { return self.GetNumHeldBlocks(id.value, w.value); },
          py::arg("request_id"), py::arg("window_size"), "Blocks the sequence holds in the window now.")
      .def(
          "_set_final_tokens", [](M& self, RequestId id, FinalTokens n) { self.SetFinalTokens(id.value, n.value); },
          py::arg("request_id"), py::arg("final_tokens"),
          "Records the most tokens the sequence will hold (prompt + max_new_tokens - 1), for the estimates.")
      .def(
          "_first_length_mismatch",
          [](const M& self, const py::handle& ids, const py::handle& lengths) {
            thread_local std::vector<SeqId> v;
            thread_local std::vector<std::int32_t> l;
            ToRequestIds(ids, "request ids", &v);
            ToLengths(lengths, &l);
            if (v.size() != l.size()) ThrowInvalid("request ids and lengths must pair up");
            return self.FirstLengthMismatch(v.data(), l.data(), v.size());
          },
          py::arg("request_ids"), py::arg("lengths"),
          "The first index whose sequence is not registered or holds another number of tokens, or -1.")
      .def(
          "_reached_final_tokens",
          [](const M& self, const py::handle& ids) {
            thread_local std::vector<SeqId> v;
            ToRequestIds(ids, "request ids", &v);
            return self.ReachedFinalTokens(v.data(), v.size());
          },
          py::arg("request_ids"),
          "The indices, ascending, whose sequence holds at least its final tokens (_set_final_tokens): the "
          "requests whose token sampled this step is their last. KeyError for an unregistered id.");
}

}  // namespace kvcache::py
