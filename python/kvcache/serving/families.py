"""Beam families for the capacity scheduler: the beams (or samples) of one request.

:meth:`KVCacheResourceManager.fork_resources` puts a parent and its children in one family
(:attr:`Request.family_id`: the id of the request first forked). The native scheduler
(``kvcache._core.CapacityScheduler.schedule``) receives each running request's and each
candidate's family id and decides:

* a family decodes only when every member is registered and past its prompt, and then all
  of its members decode in the same step or none does (the token budget takes the family's
  tokens at once);
* ``max_utilization`` pauses whole families (the newest running request's family);
* paused members are admitted again in order, and when nothing can run because registered
  members wait for siblings that do not fit, the newest such family is paused as well.

A request with ``num_beams`` or ``n`` above 1 that was not forked yet has no family; the
scheduler charges (``guaranteed_no_evict``) and checks (never fits) the ``k - 1`` beams it will
fork after its prompt (:func:`unforked_beams`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcache.serving.request import Request, RequestState

_WAITING = (RequestState.WAITING, RequestState.PAUSED)

__all__ = ["family_arrays", "join_family", "unforked_beams", "waiting_families"]

#: Family arrays for ``_core.CapacityScheduler.schedule``: running families, running beams
#: still to fork, running final tokens, candidate families, candidate beams still to fork.
FamilyArrays = tuple[list[int], list[int], list[int], list[int], list[int]]


def join_family(parent: Request, children: Sequence[Request]) -> None:
    """Puts forked ``children`` in ``parent``'s family (a new one, named after the parent,
    if it has none)."""
    family = parent.family_id if parent.family_id is not None else parent.request_id
    parent.family_id = family
    for child in children:
        child.family_id = family


def unforked_beams(request: Request) -> int:
    """Beams the request will still fork after its prompt: ``num_beams - 1`` (or ``n - 1``)
    before its first fork, 0 once it belongs to a family."""
    return request.num_sequences - 1 if request.family_id is None else 0


def family_arrays(running: Sequence[Request], candidates: Sequence[Request]) -> FamilyArrays | None:
    """The scheduler's family arguments, or ``None`` when no request has a family or beams to
    fork (the scheduler then plans each request alone, as before families)."""
    if not any(r.family_id is not None or r.num_sequences > 1 for r in (*running, *candidates)):
        return None
    return (
        [-1 if r.family_id is None else r.family_id for r in running],
        [unforked_beams(r) for r in running],
        [r.max_kv_tokens for r in running],
        [-1 if r.family_id is None else r.family_id for r in candidates],
        [unforked_beams(r) for r in candidates],
    )


def waiting_families(requests: Iterable[Request]) -> list[int]:
    """Families with a member that waits (not admitted yet, or paused): such a family does
    not decode, wherever the member stands in the queue."""
    return sorted(
        {r.family_id for r in requests if r.family_id is not None and r.state in _WAITING}
    )
