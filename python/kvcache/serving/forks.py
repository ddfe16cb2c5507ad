"""Beam search and parallel sampling in the resource manager: forking a generating request's
sequence into children that share its blocks (a mixin of
:class:`kvcache.resource_manager.KVCacheResourceManager`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.cache.fields import check_type
from kvcache.cache.manager import KVCacheManager
from kvcache.serving.families import join_family
from kvcache.serving.request import Request, RequestState

__all__ = ["ForkResources"]


class ForkResources:
    """``fork_resources`` and its checks.

    Attributes used (set by :class:`kvcache.resource_manager.KVCacheResourceManager`):
    ``_manager``, ``_running``, ``_forked``; method used: ``_register``.
    """

    _manager: KVCacheManager
    _running: dict[int, Request]
    _forked: set[int]
    _register: Callable[[Request], None]

    def fork_resources(self, parent: Request, children: Sequence[Request]) -> None:
        """Beam search and parallel sampling: registers each child as a fork of ``parent``
        (``KVCacheManager.fork_sequence``), sharing every block the parent holds.

        The parent must be generating; each child is a new :class:`Request` (waiting, not
        registered) with the parent's prompt, ``max_new_tokens`` and generated tokens but for
        the newest one, which may differ (its first step writes it: after the prompt each beam
        continues with its own token, and its first write into the shared partial block copies
        that block). The children then run as generation requests of their own: their tokens
        go into the same ``add_tokens`` call as the parent's, ``free_resources`` prunes one,
        and the estimates count each. Parent and children join one beam family
        (:attr:`Request.family_id`, the first parent's id), which the scheduler decodes, pauses
        and resumes as one. A parent with ``num_beams`` or ``n`` above 1 is no
        longer charged for beams it has not forked. All or nothing.

        Raises:
            TypeError: ``parent`` or a child is not a :class:`Request`.
            KeyError: ``parent`` holds no blocks.
            ValueError: ``parent`` is not generating; a child is registered, repeated, not
                waiting, or its prompt, ``max_new_tokens`` or generated tokens (all but the
                newest) differ from the parent's.
        """
        self._check_fork(parent, children)
        pid = parent.request_id
        self._manager.fork_sequence(pid, [c.request_id for c in children])
        join_family(parent, children)
        for child in children:
            self._manager._set_final_tokens(child.request_id, child.max_kv_tokens)
            self._register(child)
            child.state = RequestState.GENERATION
            child.context_position = parent.context_position
            child.reused_tokens = 0
        self._forked.add(pid)

    def _check_fork(self, parent: Request, children: Sequence[Request]) -> None:
        """Everything :meth:`KVCacheResourceManager.fork_resources` checks before it forks."""
        check_type("parent", parent, Request)
        for child in children:
            check_type("child", child, Request)
        pid = parent.request_id
        if pid not in self._running:
            raise KeyError(f"request {pid} holds no KV cache blocks")
        if parent.state is not RequestState.GENERATION:
            raise ValueError(
                f"request {pid}: fork a generating request (state {parent.state.value})"
            )
        seen: set[int] = set()
        cached = parent.generated[:-1]
        for child in children:
            cid = child.request_id
            if cid in self._running or cid in seen or cid == pid:
                raise ValueError(f"fork_resources: child request {cid} is registered or repeated")
            seen.add(cid)
            if child.state is not RequestState.WAITING:
                raise ValueError(
                    f"request {cid}: a child must be waiting (state {child.state.value})"
                )
            same = (
                list(child.prompt) == list(parent.prompt)
                and child.max_new_tokens == parent.max_new_tokens
                and len(child.generated) == len(parent.generated)
                and child.generated[:-1] == cached
            )
            if not same:
                raise ValueError(
                    f"request {cid}: a child of request {pid} needs its prompt, max_new_tokens "
                    "and generated tokens (all but the newest)"
                )
