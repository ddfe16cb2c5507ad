"""A hypothesis state machine that plays the engine and reads back every KV position it attends.

The fake engine writes, for every token position of a sequence, a 32-bit tag derived from the
token prefix (and the LoRA id) into K and V of every layer, and checks, right after
``add_sequence`` every reused position and before every decode step the positions each window
attends. Any mismatch is stale KV: the manager handed a request another prefix's keys and
values. ``check_invariants`` runs after every rule. The C++ test ``test_stale_kv`` runs the
same idea for millions of operations; this one lets hypothesis search for short failing
sequences through the Python API.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache import (  # noqa: E402
    NULL_BLOCK,
    KvCacheConfig,
    KVCacheManager,
    ModelConfig,
    OutOfBlocksError,
)

MAX_SEQ_LEN = 24
PREFIXES = [[], [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7]]
# (max_attention_window, tokens_per_block, blocks per window (primary, secondary), partial, copy)
CONFIGS = [
    ([4, None], 4, {4: (5, 2), 24: (10, 3)}, True, True),
    ([3, 5, None], 2, {3: (9, 0), 5: (10, 2), 24: (16, 4)}, True, False),
    ([6, 2, 9], 3, {2: (6, 2), 6: (7, 0), 9: (8, 2)}, True, True),
    ([5], 2, {5: (8, 3)}, False, True),
]


def tag(prefix: tuple[int, ...], lora: int | None) -> int:
    """The KV value of the last position of ``prefix``: never 0 (fresh memory is 0)."""
    data = np.asarray(prefix, dtype=np.int64).tobytes() + str(lora).encode()
    return zlib.crc32(data) | 1


@dataclass
class Seq:
    tokens: list[int]
    lora: int | None
    written: int = 0  # positions whose KV the engine has written
    tags: list[int] = field(default_factory=list)

    def tag_at(self, pos: int) -> int:
        while len(self.tags) <= pos:
            self.tags.append(tag(tuple(self.tokens[: len(self.tags) + 1]), self.lora))
        return self.tags[pos]


class StaleKvMachine(RuleBasedStateMachine):
    """Random engine traffic; every attended position must hold its own prefix's tag."""

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.seqs: dict[int, Seq] = {}
        self.pins: list[dict[int, list[int]]] = []
        self.next_id = 0
        self.stale: list[str] = []

    @initialize(
        config=st.sampled_from(CONFIGS),
        policy=st.sampled_from(["placeholder", "invalidate"]),
        drafts=st.sampled_from([0, 2]),
    )
    def setup(
        self,
        config: tuple[list[int | None], int, dict[int, tuple[int, int]], bool, bool],
        policy: str,
        drafts: int,
    ) -> None:
        windows, tpb, blocks, partial, copy = config
        layers = len(windows)
        model = ModelConfig(num_layers=layers, num_kv_heads=1, head_dim=2, dtype="float32")
        cfg = KvCacheConfig(
            tokens_per_block=tpb,
            max_attention_window=windows,
            backend="host",
            enable_partial_reuse=partial,
            copy_on_partial_reuse=copy,
            swa_reuse_policy=policy,  # type: ignore[arg-type]
        )
        self.m = KVCacheManager.from_blocks(
            model, cfg, blocks, max_seq_len=MAX_SEQ_LEN, max_batch_size=6, max_draft_tokens=drafts
        )
        self.tpb = tpb
        self.layer_window = self._w(windows)  # window of each layer, as the manager names it
        self.views = [self.m.get_buffers(layer).view(np.uint32) for layer in range(layers)]

    @staticmethod
    def _w(windows: list[int | None]) -> list[int]:
        return [MAX_SEQ_LEN if w is None or w >= MAX_SEQ_LEN else w for w in windows]

    # ---- the fake engine -------------------------------------------------------------------
    def _cells(self, rid: int, pos: int) -> list[tuple[np.ndarray, int]]:
        out = []
        for layer, window in enumerate(self.layer_window):
            block = self.m.get_cache_block_ids(rid, window)[pos // self.tpb]
            assert block != NULL_BLOCK, f"request {rid} position {pos} has no block"
            out.append((self.views[layer], block))
        return out

    def _write(self, rid: int, upto: int) -> None:
        s = self.seqs[rid]
        for pos in range(s.written, upto):
            t = s.tag_at(pos)
            for view, block in self._cells(rid, pos):
                view[block, 0, 0, pos % self.tpb, 0] = t
                view[block, 1, 0, pos % self.tpb, 0] = t ^ 0xFFFFFFFF
        s.written = max(s.written, upto)

    def _check(self, rid: int, start: int, end: int, window_only: bool) -> None:
        s = self.seqs[rid]
        for layer, window in enumerate(self.layer_window):
            ids = self.m.get_cache_block_ids(rid, window)
            lo = max(0, end - window) if window_only else start
            for pos in range(lo, end):
                block = ids[pos // self.tpb]
                if block == NULL_BLOCK:
                    assert not window_only, f"attended position {pos} was released"
                    continue
                got_k = int(self.views[layer][block, 0, 0, pos % self.tpb, 0])
                got_v = int(self.views[layer][block, 1, 0, pos % self.tpb, 0])
                want = s.tag_at(pos)
                if got_k != want or got_v != want ^ 0xFFFFFFFF:
                    self.stale.append(f"request {rid} window {window} pos {pos} block {block}")
        assert not self.stale, self.stale

    # ---- rules -----------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < 6)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(1, 4), min_size=1, max_size=4),
        lora=st.sampled_from([None, None, 3]),
        store=st.booleans(),
    )
    def add(self, prefix: list[int], tail: list[int], lora: int | None, store: bool) -> None:
        tokens = (prefix + tail)[: MAX_SEQ_LEN - 4]
        rid = self.next_id
        self.next_id += 1
        free = [self.m.get_num_free_blocks(w) for w in self.m.window_sizes]
        try:
            reused = self.m.add_sequence(rid, tokens, lora_task_id=lora)
        except OutOfBlocksError:
            assert free == [self.m.get_num_free_blocks(w) for w in self.m.window_sizes]
            return
        self.seqs[rid] = Seq(list(tokens), lora, written=reused)
        self._check(rid, 0, reused, window_only=False)
        self._write(rid, len(tokens))
        if store:
            self.m.store_context_blocks(rid)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        ids = [r for r, s in self.seqs.items() if len(s.tokens) < MAX_SEQ_LEN]
        if not ids:
            return
        batch = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
        new = []
        for rid in batch:
            s = self.seqs[rid]
            self._write(rid, len(s.tokens))  # the step computes the last token's KV
            self._check(rid, 0, len(s.tokens), window_only=True)
            new.append(s.tag_at(len(s.tokens) - 1) % 5 + 1)  # greedy: same prefix, same token
        try:
            self.m.add_tokens(batch, new)
        except OutOfBlocksError:
            self.remove_newest()
            return
        for rid, token in zip(batch, new, strict=True):
            self.seqs[rid].tokens.append(token)

    @precondition(lambda self: 0 < len(self.seqs) <= 4)  # max_batch_size 6
    @rule(data=st.data(), k=st.integers(1, 2), together=st.booleans())
    def fork(self, data: st.DataObject, k: int, together: bool) -> None:
        """Beam search: forks a request into k children (they read the parent's KV through the
        shared blocks) and, if ``together``, steps the family in one add_tokens call with a
        different token each (the beams diverge; shared partial blocks are copied on write)."""
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        p = self.seqs[parent]
        kids = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        self.m.fork_sequence(parent, kids)
        for c in kids:
            self.seqs[c] = Seq(list(p.tokens), p.lora, written=p.written, tags=list(p.tags))
            assert self.m.num_tokens(c) == len(p.tokens)
            self._check(c, 0, p.written, window_only=False)
        if not together or len(p.tokens) >= MAX_SEQ_LEN:
            return
        family = [parent, *kids]
        for rid in family:
            self._write(rid, len(self.seqs[rid].tokens))
            self._check(rid, 0, len(self.seqs[rid].tokens), window_only=True)
        greedy = p.tag_at(len(p.tokens) - 1) % 5 + 1
        new = [(greedy + i - 1) % 5 + 1 for i in range(len(family))]  # all different
        try:
            self.m.add_tokens(family, new)
        except OutOfBlocksError:
            self.remove_newest()
            return
        for rid, token in zip(family, new, strict=True):
            self.seqs[rid].tokens.append(token)

    def remove_newest(self) -> None:
        rid = max(self.seqs)
        self.m.remove_sequence(rid, store_for_reuse=False)
        del self.seqs[rid]

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        self.m.store_context_blocks(data.draw(st.sampled_from(sorted(self.seqs))))

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.do_rewind(rid, data.draw(st.integers(0, len(self.seqs[rid].tokens) - 1)))

    def do_rewind(self, rid: int, k: int) -> None:
        s = self.seqs[rid]
        try:
            self.m.rewind(rid, k)
        except (ValueError, OutOfBlocksError):
            assert self.m.num_tokens(rid) == len(s.tokens)
            return
        del s.tokens[len(s.tokens) - k :]
        del s.tags[len(s.tokens) :]
        s.written = min(s.written, len(s.tokens))

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), store=st.booleans(), pin=st.booleans())
    def remove(self, data: st.DataObject, store: bool, pin: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        del self.seqs[rid]
        pinned = self.m.remove_sequence(rid, store_for_reuse=store, pin=pin)
        if pin:
            self.pins.append(pinned)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.pins.append(self.m.pin_blocks(rid))

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.pins) - 1))
        self.m.unpin_blocks_by_id(self.pins.pop(i))

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "m"):
            self.m.check_invariants()


StaleKvMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=80, deadline=None, derandomize=True
)
TestStaleKv = StaleKvMachine.TestCase


def test_store_after_rewind_below_the_prompt() -> None:
    """The first failure hypothesis found before the fix (store_context_blocks used the old
    prompt length after a rewind and cached another request's block under this prefix)."""
    machine = StaleKvMachine()
    machine.setup(config=CONFIGS[2], policy="placeholder", drafts=0)
    machine.add(prefix=[], tail=[1], lora=None, store=False)
    machine.add(prefix=[1, 2, 3, 4, 5], tail=[1, 1], lora=None, store=True)
    machine.do_rewind(0, 0)
    machine.do_rewind(1, 3)
    machine.add(prefix=[1, 2, 3, 4, 5], tail=[1], lora=None, store=False)
    machine.m.store_context_blocks(1)
    # The third request reads every reused position.
    machine.add(prefix=[1, 2, 3, 4, 5], tail=[1], lora=None, store=False)
    machine.consistent()
