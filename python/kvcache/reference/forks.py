"""Beam search and parallel sampling in :class:`kvcache.engine.Engine`: the families of forked
sequences of one ``generate_detailed`` call (picks each step's tokens, forks and frees)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcache._extras import missing_extra

try:
    import torch
except ImportError as e:
    raise missing_extra("kvcache.engine_forks", "torch", e) from None

from kvcache.reference.beam_search import BeamState
from kvcache.serving.request import Request, RequestState

if TYPE_CHECKING:
    from kvcache.serving.resource_manager import KVCacheResourceManager

__all__ = ["ForkBooks", "Forks"]


@dataclass
class ForkBooks:
    """What the families change of the engine that runs them, handed over explicitly: its
    resource manager, its counters (``generated_tokens``, ``requests``) and its request ids."""

    rm: KVCacheResourceManager
    counters: dict[str, int]
    new_id: Callable[[], int]


# --------------------------------------------------------------------------------------
# Beam search and parallel sampling: families of forked sequences
# --------------------------------------------------------------------------------------


@dataclass
class _Family:
    """One prompt's sequences: its beams (beam search) or samples (``n > 1``)."""

    index: int
    root: Request
    beam: BeamState | None  # beam search; None: n samples
    n: int
    rows: list[Request]  # beam: the request of each running beam (repeats until forked)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # beam: logits waiting
    stash: dict[int, int] = field(default_factory=dict)  # beam: newest token of a paused beam
    samples: list[Request] = field(default_factory=list)  # n: the samples, in order
    logprob: dict[int, float] = field(default_factory=dict)  # n: summed log-probability
    done: bool = False


class Forks:
    """The families of one :meth:`Engine.generate_detailed` call with ``num_beams`` or ``n``
    above 1: picks each step's tokens and forks and frees the sequences.

    A family is one scheduling unit of the scheduler (``Request.family_id``, set by
    ``fork_resources``): it decodes all its beams in one step or none, and pauses and resumes
    them together, so each step scores all the beams of a family at once. A paused beam gives
    back its newest token (its KV was not written yet); it resumes as a context request of
    its prompt and the tokens before it (reusing the cached prefix), its last chunk takes
    that token back instead of a sampled one, and it waits (registered) until its siblings
    are back too.
    """

    def __init__(
        self,
        books: ForkBooks,
        roots: list[Request],
        *,
        num_beams: int,
        n: int,
        eos: Sequence[int],
        length_penalty: float,
        early_stopping: bool | str,
        generator: torch.Generator | None,
        temperature: float,
    ) -> None:
        self._books = books
        self._generator = generator
        self._temperature = temperature
        self.families: list[_Family] = []
        self._owner: dict[int, _Family] = {}
        for i, root in enumerate(roots):
            beam = None
            if num_beams > 1:
                beam = BeamState(num_beams, root.max_new_tokens, eos, length_penalty,
                                 early_stopping)  # fmt: skip
            fam = _Family(i, root, beam, n, [root] * num_beams)
            self.families.append(fam)
            self._owner[root.request_id] = fam
        self.active: list[Request] = list(roots)

    def runnable(self) -> list[Request]:
        """The active requests, family by family in prompt order: the scheduler decodes,
        pauses and resumes each family as one (``Request.family_id``), and a family's paused
        beams resume before later prompts are admitted."""
        owner = self._owner
        return sorted(self.active, key=lambda r: owner[r.request_id].index)

    def paused(self, requests: list[Request]) -> None:
        """The scheduler paused these (whole families, blocks stored for reuse): each beam
        gives back its newest token, whose KV was not written, to take it again when its
        context is done."""
        for r in requests:
            fam = self._owner[r.request_id]
            if fam.beam is None:
                continue  # a sample resumes like any request: its context includes the token
            fam.pending.pop(r.request_id, None)
            if r.generated and r.request_id not in fam.stash:
                fam.stash[r.request_id] = r.generated.pop()

    def choose(self, sampled: list[Request], logits: torch.Tensor) -> list[Callable[[], None]]:
        """Appends the step's tokens; returns the forks and frees to run after the step."""
        after: list[Callable[[], None]] = []
        ready: list[_Family] = []
        for r, row in zip(sampled, logits, strict=True):
            fam = self._owner[r.request_id]
            if fam.beam is None:
                after += self._sample(fam, r, row)
            elif r.request_id in fam.stash:  # a resumed beam caught up: its token back
                r.append_tokens([fam.stash.pop(r.request_id)])
            else:
                fam.pending[r.request_id] = row
                if all(b.request_id in fam.pending for b in self._live(fam)):
                    ready.append(fam)
        for fam in ready:
            after.append(self._beam_step(fam))
        for fam in self.families:
            if fam.pending and fam not in ready:
                raise RuntimeError(
                    f"prompt {fam.index}: the scheduler decoded some beams of the family "
                    "without the others"
                )
        return after

    # ------------------------------------------------------------------ internals

    def _live(self, fam: _Family) -> list[Request]:
        """The family's distinct sequences, in row order."""
        seen: dict[int, Request] = {}
        for r in fam.rows if fam.beam is not None else fam.samples or [fam.root]:
            seen.setdefault(r.request_id, r)
        return list(seen.values())

    def _child(self, parent: Request, token: int) -> Request:
        return Request(self._books.new_id(), list(parent.prompt), parent.max_new_tokens,
                       generated=[*parent.generated[:-1], token])  # fmt: skip

    def _beam_step(self, fam: _Family) -> Callable[[], None]:
        """Scores a family whose beams all have their logits; records each kept beam's
        token now, and returns the frees and forks that reorder the beams."""
        assert fam.beam is not None
        rows = torch.stack([fam.pending[r.request_id] for r in fam.rows])
        fam.pending.clear()
        decided = fam.beam.step(rows)
        self._books.counters["generated_tokens"] += len(fam.rows)
        kept: dict[int, Request] = {}
        forks: dict[int, list[Request]] = {}
        new_rows: list[Request] = []
        for parent_row, token in zip(decided.parents, decided.tokens, strict=True):
            parent = fam.rows[parent_row]
            pid = parent.request_id
            if pid not in kept:
                kept[pid] = parent
                parent.append_tokens([token])
                new_rows.append(parent)
            else:
                child = self._child(parent, token)
                forks.setdefault(pid, []).append(child)
                new_rows.append(child)
        pruned = [r for r in self._live(fam) if r.request_id not in kept]
        fam.rows = new_rows

        def reorder() -> None:
            rm = self._books.rm
            for r in pruned:  # first: their blocks serve the forks' copies
                rm.free_resources(r, store_for_reuse=False)
                self.active.remove(r)
            if decided.done:
                self._end(fam)
                return
            for pid, children in forks.items():
                rm.fork_resources(kept[pid], children)
                for c in children:
                    self._owner[c.request_id] = fam
                    self.active.append(c)

        return reorder

    def _sample(self, fam: _Family, r: Request, row: torch.Tensor) -> list[Callable[[], None]]:
        """n > 1: draws the sample's token (the root's first: n tokens, n - 1 forks)."""
        logp = torch.log_softmax(row.float() / self._temperature, dim=-1)
        first = not fam.samples
        draws = torch.multinomial(logp.exp(), fam.n if first else 1, replacement=True,
                                  generator=self._generator).tolist()  # fmt: skip
        self._books.counters["generated_tokens"] += len(draws)
        r.append_tokens([draws[0]])
        if not first:
            fam.logprob[r.request_id] += float(logp[draws[0]])
            return [lambda: self._maybe_end(fam, r)]
        children = [self._child(r, t) for t in draws[1:]]
        fam.samples = [r, *children]
        for s, t in zip(fam.samples, draws, strict=True):
            fam.logprob[s.request_id] = float(logp[t])
            self._owner[s.request_id] = fam

        def fork() -> None:
            if r.is_finished:  # one new token: nothing to fork, nothing more to run
                for c in children:
                    c.state = RequestState.FINISHED
                self._maybe_end(fam, r)
                return
            self._books.rm.fork_resources(r, children)
            self.active += children

        return [fork]

    def _maybe_end(self, fam: _Family, r: Request) -> None:
        if not r.is_finished:
            return
        if self._books.rm.has_request(r):
            self._books.rm.free_resources(r)
            self._books.counters["requests"] += 1
        if r in self.active:
            self.active.remove(r)
        fam.done = all(s.is_finished for s in fam.samples)

    def _end(self, fam: _Family) -> None:
        """The search ended: frees the running beams (the best one stored for reuse)."""
        rm = self._books.rm
        for i, r in enumerate(self._live(fam)):
            if rm.has_request(r):
                rm.free_resources(r, store_for_reuse=i == 0)
            if r in self.active:
                self.active.remove(r)
        fam.done = True
        self._books.counters["requests"] += 1

    def release(self) -> None:
        """After an error: frees whatever is still registered."""
        rm = self._books.rm
        for r in self.active:
            if rm.has_request(r):
                rm.free_resources(r, store_for_reuse=False)

    def result(self) -> tuple[list[list[list[int]]], list[list[float]]]:
        """Every family's outputs (finished beams best first, or samples in order) and
        their scores, in prompt order."""
        seqs: list[list[list[int]]] = []
        scores: list[list[float]] = []
        for fam in self.families:
            if fam.beam is not None:
                fin = fam.beam.finished
                seqs.append([t for t, _ in fin])
                scores.append([s for _, s in fin])
            else:
                seqs.append([list(s.generated) for s in fam.samples])
                scores.append([fam.logprob[s.request_id] for s in fam.samples])
        return seqs, scores
