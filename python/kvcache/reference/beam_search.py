"""Beam search scoring of one request, step by step, with Hugging Face ``generate``'s rules.

Optional: needs ``torch``. :class:`BeamState` holds one request's ``k`` running beams (their
cumulative log-probabilities) and its ``k`` best finished hypotheses; :meth:`BeamState.step`
takes the next-token logits of every running beam and says which beam each new running beam
continues with which token. The engine (:mod:`kvcache.engine`) turns that into forks and frees
of cache sequences; this module knows nothing of the cache.

The rules are those of ``transformers``' beam search (``num_beams=k, do_sample=False``):

* the log-softmax of each beam's fp32 logits plus the beam's running score; the top
  ``max(2, 1 + number of EOS ids) * k`` candidates over all beams (one ``topk`` over the
  flattened ``k * vocab`` scores; at the first step every beam but the first scores -1e9);
* a candidate ends its hypothesis when its token is an EOS id or it reaches
  ``max_new_tokens``; only candidates among the first ``k`` may enter the finished list,
  scored ``sum of log-probabilities / generated_length ** length_penalty`` (EOS counted);
* the next running beams are the best ``k`` candidates that did not end;
* ``early_stopping=True`` stops adding hypotheses once ``k`` are finished, and ends the
  search then; ``False`` ends it when the best running beam, scored at its current length,
  cannot beat the worst finished hypothesis; ``"never"`` with a positive length penalty
  scores it at ``max_new_tokens`` instead;
* the search also ends when every candidate of a step ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache._extras import missing_extra

try:
    import torch
except ImportError as e:
    raise missing_extra("kvcache.beam_search", "torch", e) from None

__all__ = ["BeamState", "BeamStep"]

_NEG = -1.0e9


@dataclass(frozen=True)
class BeamStep:
    """What one step decided.

    Attributes:
        parents: For each new running beam, in rank order, the index of the beam it continues.
        tokens: Each new running beam's token.
        done: The search ended (read :attr:`BeamState.finished`).
    """

    parents: list[int]
    tokens: list[int]
    done: bool


class BeamState:
    """One request's beam search state (see the module docstring for the rules).

    Args:
        num_beams: ``k`` (>= 1).
        max_new_tokens: Longest output.
        eos_token_ids: Tokens that end a hypothesis.
        length_penalty: Exponent of the generated length in a finished hypothesis's score.
        early_stopping: ``True``, ``False`` or ``"never"``.

    Raises:
        ValueError: ``num_beams`` below 1 or ``early_stopping`` not one of the three.
    """

    def __init__(
        self,
        num_beams: int,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        length_penalty: float,
        early_stopping: bool | str,
    ) -> None:
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        k = num_beams
        self.num_beams = k
        self.max_new_tokens = max_new_tokens
        self._eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self._keep = max(2, 1 + len(self._eos)) * k
        self._top = torch.arange(self._keep) < k
        self.running_scores = torch.zeros(k, dtype=torch.float32)
        self.running_scores[1:] = _NEG
        self.running_tokens: list[list[int]] = [[] for _ in range(k)]
        self._fin_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self._fin_flags = torch.zeros(k, dtype=torch.bool)
        self._fin_tokens: list[list[int]] = [[] for _ in range(k)]
        self._improvable = True
        self.done = False

    @property
    def finished(self) -> list[tuple[list[int], float]]:
        """The finished hypotheses, best first: (generated tokens, score)."""
        return [
            (list(t), float(s))
            for t, s, f in zip(self._fin_tokens, self._fin_scores, self._fin_flags, strict=True)
            if bool(f)
        ]

    def step(self, logits: torch.Tensor) -> BeamStep:
        """Scores the next token of every running beam (``logits``: ``[k, vocab]``).

        Raises:
            RuntimeError: The search already ended.
            ValueError: ``logits`` is not ``[k, vocab]``.
        """
        if self.done:
            raise RuntimeError("the beam search already ended")
        k = self.num_beams
        if logits.dim() != 2 or logits.shape[0] != k:
            raise ValueError(f"logits must be [{k}, vocab], got {list(logits.shape)}")
        vocab = logits.shape[1]
        acc = torch.log_softmax(logits.float(), dim=-1) + self.running_scores[:, None]
        cand_scores, flat = torch.topk(acc.reshape(1, -1), k=self._keep)
        cand_scores, flat = cand_scores[0], flat[0]
        rows = flat // vocab
        tokens = flat % vocab
        length = len(self.running_tokens[0]) + 1  # generated tokens after this step
        ends = torch.isin(tokens, self._eos) | (length >= self.max_new_tokens)
        cand_tokens = [
            [*self.running_tokens[int(r)], int(t)] for r, t in zip(rows, tokens, strict=True)
        ]
        # The next running beams: the best k candidates that did not end.
        running = cand_scores + ends.to(torch.float32) * _NEG
        chosen = torch.topk(running, k=k)[1]
        self._finish(cand_scores, cand_tokens, ends, length)
        self.running_scores = running[chosen]
        self.running_tokens = [cand_tokens[int(i)] for i in chosen]
        self._update_stop(length)
        self.done = not (
            self._improvable
            and not (bool(self._fin_flags.all()) and self.early_stopping is True)
            and not bool(ends.all())
        )
        return BeamStep(
            parents=[int(rows[i]) for i in chosen],
            tokens=[int(tokens[i]) for i in chosen],
            done=self.done,
        )

    def _finish(
        self, scores: torch.Tensor, seqs: list[list[int]], ends: torch.Tensor, length: int
    ) -> None:
        """Merges the candidates that ended among the first k into the finished list."""
        k = self.num_beams
        just = ends & self._top
        fin = scores / (length**self.length_penalty)
        full = bool(self._fin_flags.all()) and self.early_stopping is True
        fin = fin + torch.tensor(float(full)) * _NEG
        fin = fin + torch.tensor(float(not self._improvable)) * _NEG
        fin = fin + (~just) * _NEG
        merged = torch.cat((self._fin_scores, fin))
        flags = torch.cat((self._fin_flags, just))
        tokens = [*self._fin_tokens, *seqs]
        best = torch.topk(merged, k=k)[1]
        self._fin_scores = merged[best]
        self._fin_flags = flags[best]
        self._fin_tokens = [tokens[int(i)] for i in best]

    def _update_stop(self, length: int) -> None:
        """Whether a running beam may still beat the worst finished hypothesis."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            hypothetical = self.max_new_tokens
        else:
            hypothetical = length
        best = self.running_scores[:1] / (hypothetical**self.length_penalty)
        worst = torch.where(self._fin_flags, self._fin_scores.min(), torch.tensor(_NEG))
        self._improvable = self._improvable and bool((best > worst).any())
