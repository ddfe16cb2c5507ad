"""The ``kvcache`` command line: ``models``, ``plan``, ``simulate`` and ``generate``.

Errors print one line to stderr and never a traceback. Exit status: 0 success; 2 a bad
command line or input (unknown option, bad value, unreadable or malformed file, a budget
that holds nothing, an output path that cannot be written; nothing was written); 1 a
failure of the run itself (out of memory, an internal error); 130 interrupted; 141 stdout
closed early (``kvcache models | head``).

Limits, each with its reason: sizes (``--memory``, ``--host-cache``, ``--disk-cache``) at
most 1 PiB (more than any one device or host has; larger values are typos); ``--max-seq-len``,
``--tokens-per-block`` and ``--max-batch-size`` at most 2**31-1 (32-bit in the core);
``--draft-tokens`` at most 256; ``--num-conversations`` at most 10,000 (the built-in
workload is generated in memory; replay larger workloads with ``--trace``).

Example:
    $ kvcache models
    $ kvcache plan --model gemma-3-27b --memory 80GiB --max-seq-len 32768
    $ kvcache plan --model gemma-4-31b --memory 80GiB --kv-cache-dtype full=fp8
    $ kvcache simulate --model gemma-3-12b --memory 24GiB --shares auto
    $ kvcache generate --model gemma3 --num-prompts 32   # needs the torch extra
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NoReturn

from kvcache.cache.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SHARE_POLICIES,
    KvCacheConfig,
)
from kvcache.cache.sizing import (
    format_size,
    parse_size,
    resolve_share_policy,
    window_sizes,
)
from kvcache.cli.generate import (  # imports no torch: --help works without it
    add_arguments,
    add_scheduler_option,
)
from kvcache.cli.plan import (
    DEFAULT_TOKENS_PER_BLOCK,
    PlanRow,
    PolicyPlan,
    joined,
    make_plan,
    one_sequence,
    plan_json,
    render_plan,
    too_small,
)
from kvcache.models import list_models, load_model

__all__ = ["MAX_SIZE_BYTES", "PlanRow", "PolicyPlan", "main", "make_plan"]

_PROG = "kvcache"

#: Largest ``--memory`` / ``--host-cache`` / ``--disk-cache`` accepted (1 PiB): more than any
#: single device or host has, so a larger value is a typo (``10000TiB``, ``1e30``).
MAX_SIZE_BYTES = 2**50
_INT32_MAX = 2**31 - 1
_MAX_DRAFT_TOKENS = 256
_MAX_CONVERSATIONS = 10_000
_MAX_ENGINES = 64  # kvcache.simulate.fleet.MAX_ENGINES (not imported: --help stays light)


class _UsageError(Exception):
    """A command-line mistake; reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """Errors raise :class:`_UsageError`; an unknown option is reported (with the closest
    known one) before a missing required one, and a negative size such as ``-5GiB`` reaches
    its option's type as a value instead of being taken for an option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-5GiB" for an option (it knows "-5" and "-.5" only); no option of
        # this parser starts with a digit, so any "-<digit>..." is a value.
        self._negative_number_matcher = re.compile(r"^-\.?\d")
        self._required_later: list[tuple[str, str]] = []  # (dest, option) checked after parsing

    def add_required(self, *flags: str, **kwargs: Any) -> argparse.Action:
        """An option that must be given, checked after the unknown options are reported."""
        action = self.add_argument(*flags, default=None, **kwargs)
        action.help = (action.help or "") + " (required)"
        self._required_later.append((action.dest, flags[0]))
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # a subcommand ("kvcache plan"): name the typo here
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        missing = [flag for dest, flag in self._required_later if getattr(ns, dest) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return ns, extras

    def _suggestion(self, extras: Sequence[str]) -> str:
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if extra.startswith("-") and close:
                return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message}")


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    preset = load_model(args.model)
    memory: int = args.memory
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else preset.max_context
    tpb: int = args.tokens_per_block
    policies: list[str | Sequence[float]] = list(SHARE_POLICIES)
    if args.shares is not None and args.shares not in policies:
        policies.append(args.shares)
    # What an engine would use with no shares configured: the environment, if set.
    env_policy, env_source = resolve_share_policy(None)
    env_var = env_source.removeprefix("environment variable ") if env_source != "default" else ""
    if env_var:
        n_windows = len(window_sizes(preset.model, preset.kv_cache_config(), max_seq_len))
        hybrid = preset.model.recurrent_layers > 0  # the state pool is one more share
        if not isinstance(env_policy, str) and len(env_policy) != n_windows + hybrid:
            state = " and a recurrent state pool (its share last)" if hybrid else ""
            raise ValueError(
                f"{env_var} gives {len(env_policy)} share(s) but {preset.name} has "
                f"{n_windows} window(s) at {max_seq_len:,} tokens{state}; give one share per "
                "window in ascending window order"
            )
        if env_policy not in policies:
            policies.append(env_policy)
    dtype_choice = args.kv_cache_dtype
    caps = [c for c in (args.max_chunk_size, args.max_num_batched_tokens) if c is not None]
    chunk = None if args.no_chunked_prefill else min(caps)
    need, per_window = one_sequence(
        preset, max_seq_len, tpb, dtype_choice, chunk, args.max_draft_tokens
    )
    if memory < need:
        raise ValueError(too_small(args, preset, memory, need, per_window, max_seq_len, chunk))
    plan = make_plan(
        preset,
        memory,
        max_seq_len,
        tokens_per_block=tpb,
        policies=policies,
        kv_cache_dtype=dtype_choice,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_chunk_size=args.max_chunk_size,
        chunked_prefill=not args.no_chunked_prefill,
        max_draft_tokens=args.max_draft_tokens,
    )
    if env_var:
        plan["policies"] = [
            dataclasses.replace(p, source=env_var) if policy == env_policy else p
            for p, policy in zip(plan["policies"], policies, strict=True)
        ]
    if max(p.max_sequences for p in plan["policies"]) == 0:
        raise ValueError(
            f"{format_size(memory)} fits no sequence of {max_seq_len:,} tokens of "
            f"{preset.name} under any share policy (one needs {format_size(need)} split "
            "exactly: " + per_window + "); give more --memory or a shorter --max-seq-len"
        )
    if args.json:
        print(json.dumps(plan_json(plan), indent=2))
    else:
        render_plan(plan, sys.stdout)
    return 0


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------


def _cmd_models(args: argparse.Namespace) -> int:
    presets = [load_model(name) for name in list_models()]
    if args.json:
        rows = []
        for p in presets:
            row: dict[str, Any] = {
                "name": p.name,
                "model": p.model.to_dict(),
                "max_attention_window": None
                if p.max_attention_window is None
                else list(p.max_attention_window),
                "max_context": p.max_context,
                "description": p.description,
                "source": p.source,
            }
            if p.model.recurrent_layers > 0:
                row["layer_types"] = None if p.layer_types is None else list(p.layer_types)
                row["state_bytes_per_sequence"] = p.model.state_bytes_per_sequence()
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return 0
    width = max([16, *(len(p.name) for p in presets)])
    print(
        f"{'name':<{width}} {'layers':>6} {'kv heads':>8} {'head dim':>8} {'dtype':<9} "
        f"{'context':>8} {'KV B/token':>11}  windows"
    )
    for p in presets:
        m = p.model
        per_token = sum(m.bytes_per_token_per_layer())
        windows = p.window_pattern_text()
        if m.recurrent_layers > 0:
            # Hybrid: ``layers`` counts the attention layers; the state is per sequence.
            windows += (
                f"; {m.recurrent_layers} recurrent layers, "
                f"{m.state_bytes_per_sequence():,} state B/seq"
            )
        print(
            f"{p.name:<{width}} {m.num_layers:>6} {joined(m.kv_heads_per_layer()):>8} "
            f"{joined(m.head_dim_per_layer()):>8} {joined(m.dtype_per_layer()):<9} "
            f"{p.max_context:>8,} {per_token:>11,}  {windows}"
        )
    return 0


# --------------------------------------------------------------------------------------
# simulate
# --------------------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.num_requests is not None:
        raise _UsageError(
            f"{_PROG} simulate: error: --num-requests is now --num-conversations: the "
            "built-in workload counts conversations of 1-6 requests (one per turn)"
        )
    from kvcache.simulate.command import run_cli  # only this command needs the simulator

    return run_cli(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvcache.cli.generate import run_cli  # imports torch and transformers

    return run_cli(args)


def _int_in(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..hi``; ``why`` explains the upper bound."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        if value > hi:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"{text!r} is more than {hi:,}{reason}")
        return value

    return parse


_positive_int32 = _int_in(1, _INT32_MAX, "the core stores it as a 32-bit integer")


def _positive_ms(text: str) -> float:
    """An argparse type: a finite number of milliseconds > 0."""
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of milliseconds, got {text!r}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of milliseconds, got {text!r}"
        )
    return value


_non_negative_int32 = _int_in(0, _INT32_MAX, "the core stores it as a 32-bit integer")


_DECIMAL_UNITS = ("kb", "mb", "gb", "tb", "pb")
_BARE_NUMBER_LIMIT = 2**20  # a unitless size below 1 MiB is a forgotten unit, not a budget


def _size_type(notes: list[str]) -> Callable[[str], int]:
    """An argparse type: a byte count such as ``80GiB``, at most :data:`MAX_SIZE_BYTES`.

    A decimal unit (``80GB``) is taken as written and adds a note to ``notes`` saying the
    bytes and the binary size; a unitless number below 1 MiB (``80``) is refused: the unit
    was forgotten.
    """

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value > MAX_SIZE_BYTES:
            raise argparse.ArgumentTypeError(
                f"{text!r} is {format_size(value) if value < 2**60 else f'{value:.3g} bytes'}, "
                "more than 1 PiB, the most kvcache accepts: no single device or host has that "
                "much memory"
            )
        number, unit = _split_unit(text)
        if not unit and 0 < value < _BARE_NUMBER_LIMIT:
            raise argparse.ArgumentTypeError(
                f"{text!r} has no unit, so it means {value:,} bytes; write the unit, e.g. "
                f"{number}GiB (or {number}B if you mean bytes)"
            )
        if unit.lower() in _DECIMAL_UNITS:
            notes.append(
                f"note: {text.strip()!r} is decimal: {value:,} bytes = {format_size(value)} "
                f"({number}{unit[0].upper()}iB would be {parse_size(number + unit[0] + 'iB'):,} "
                "bytes)"
            )
        return value

    return parse


def _split_unit(text: str) -> tuple[str, str]:
    """``" 80 GB"`` -> ``("80", "GB")``: the number and the unit as written."""
    s = text.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    return s[:i].strip(), s[i:]


def _shares(text: str) -> str | tuple[float, ...]:
    """An argparse type: a share policy name or comma-separated shares."""
    try:
        value = KvCacheConfig(window_size_shares=text).window_size_shares
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("window_size_shares: ")) from None
    assert value is not None
    return value if isinstance(value, str) else tuple(value)


def _kv_cache_dtype(text: str) -> str | dict[int | str | None, str]:
    """An argparse type: ``fp8`` (every layer), or ``KEY=DTYPE,...`` with keys ``full``,
    ``sliding`` or a window size (``full=fp8,sliding=bfloat16``, ``1024=bfloat16``)."""
    value: str | dict[int | str | None, str] = text.strip()
    if "=" in text:
        value = {}
        for part in text.split(","):
            key, sep, dtype = part.partition("=")
            if not sep or not key.strip():
                raise argparse.ArgumentTypeError(
                    f"expected a dtype or KEY=DTYPE pairs such as full=fp8,sliding=bfloat16; "
                    f"got {part.strip()!r}"
                )
            value[key.strip()] = dtype.strip()
    try:
        checked = KvCacheConfig(kv_cache_dtype=value).kv_cache_dtype
    except ValueError as e:
        hint = ""
        if isinstance(value, str):  # one dtype that is not one: maybe a KEY=DTYPE attempt
            hint = (
                "; to choose per window kind or size give KEY=DTYPE pairs, e.g. "
                "full=fp8,sliding=bfloat16"
            )
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None
    if checked is None or isinstance(checked, str):
        return value
    return dict(checked)


def _version() -> str:
    from kvcache import __version__

    return __version__


def _build_parser(notes: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvcache`` parser; size options add their notes (decimal units) to ``notes``."""
    size = _size_type(notes if notes is not None else [])
    parser = _Parser(
        prog=_PROG,
        description="KV cache manager for LLM inference: model presets, memory planning and "
        "workload simulation for variable sliding window attention (VSWA) models.",
        epilog="Exit status: 0 success, 2 bad command line or input, 1 the run failed.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p_models = sub.add_parser(
        "models",
        help="list the built-in model presets",
        description="List the built-in model presets: layers, KV heads, head size, dtype, "
        "context and the attention window pattern of each.",
    )
    p_models.add_argument("--json", action="store_true", help="print JSON")
    p_models.set_defaults(func=_cmd_models)

    p_plan = sub.add_parser(
        "plan",
        help="blocks, tokens and max concurrent sequences per window and share policy",
        description="Plan a KV memory budget for a model: the blocks, tokens and concurrent "
        "sequences of every attention window under each share policy (equal, proportional, "
        "auto), before anything is allocated.",
        epilog="Example: kvcache plan --model gemma-3-27b --memory 80GiB --max-seq-len 32768",
    )
    assert isinstance(p_plan, _Parser)
    p_plan.usage = "%(prog)s --model NAME|FILE.json --memory SIZE [options]"
    p_plan.add_required("--model", help="preset name or preset JSON file")
    p_plan.add_required("--memory", type=size, help="primary KV memory, e.g. 80GiB (<= 1 PiB)")
    p_plan.add_argument(
        "--max-seq-len",
        type=_positive_int32,
        default=None,
        help="sequence length to plan for (default: the model's max context)",
    )
    p_plan.add_argument(
        "--tokens-per-block",
        type=_positive_int32,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help=f"tokens per KV block (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    p_plan.add_argument(
        "--shares", type=_shares, default=None, help="an extra share list to compare, e.g. 0.2,0.8"
    )
    p_plan.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        default=None,
        metavar="SPEC",
        help="KV dtype instead of the model's: one dtype (fp8), or KEY=DTYPE pairs with keys "
        "full, sliding or a window size (full=fp8,sliding=bfloat16); the plan then shows "
        "what each window's choice saves",
    )
    p_plan.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int32,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per engine step, the largest prefill chunk (default 8192, the scheduler's)",
    )
    p_plan.add_argument(
        "--max-chunk-size",
        type=_positive_int32,
        default=None,
        help="most tokens of one prefill chunk (default: the step's token budget)",
    )
    p_plan.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="plan for prompts prefilled whole in one step",
    )
    p_plan.add_argument(
        "--max-draft-tokens",
        type=_non_negative_int32,
        default=0,
        help="draft tokens per step (speculative decoding): sliding windows keep them too "
        "(default 0)",
    )
    p_plan.add_argument("--json", action="store_true", help="print JSON")
    p_plan.set_defaults(func=_cmd_plan)

    p_sim = sub.add_parser(
        "simulate",
        help="replay a workload through the manager and report pool use",
        description="Replay a workload (the built-in multi-turn chat, or a kvcache or Mooncake "
        "trace) through the manager on the virtual backend, no GPU needed, and report each "
        "window's pool use, concurrency, the prefix hit rate against the trace's ideal, and "
        "the manager's time per step; one engine, or a fleet behind a router.",
        epilog="Example: kvcache simulate --model gemma-3-12b --memory 24GiB --shares auto",
    )
    p_sim.add_argument("--model", default=None, help="preset name (default: gemma-3-12b)")
    p_sim.add_argument(
        "--memory", type=size, default=None, help="primary KV memory (default: 16GiB)"
    )
    p_sim.add_argument(
        "--shares",
        type=_shares,
        default=None,
        help="equal | proportional | auto | a,b,... (default: KVCACHE_WINDOW_SIZE_SHARES, "
        "else equal); auto(L=N) in the report means auto sized for sequences of N tokens",
    )
    p_sim.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="JSON Lines trace to replay: kvcache's format or Mooncake's (timestamp, "
        "input_length, output_length, hash_ids), streamed",
    )
    p_sim.add_argument(
        "--first",
        type=_int_in(1, 2**63 - 1),
        default=None,
        metavar="N",
        help="replay only the first N requests of --trace (file order)",
    )
    p_sim.add_argument(
        "--arrival",
        choices=["timestamps", "asap"],  # kvcache.simulate.ARRIVAL_MODES
        default="timestamps",
        help="timestamps: requests arrive when the trace says; asap: all at step 0, in file "
        "order (default: timestamps)",
    )
    p_sim.add_argument(
        "--step-ms",
        type=_positive_ms,
        default=None,
        metavar="MS",
        help="milliseconds per engine step: a Mooncake timestamp t arrives at step "
        "floor(t / MS) (default 50)",
    )
    p_sim.add_argument(
        "--no-bounds",
        action="store_true",
        help="skip the offline bounds (ideal, LRU and Belady hit rates of the trace) and the "
        "lost-hit split",
    )
    p_sim.add_argument(
        "--max-batch-size",
        type=_positive_int32,
        default=None,
        help="most requests running at once (default 128)",  # simulate.DEFAULT_MAX_BATCH_SIZE
    )
    p_sim.add_argument(
        "--max-seq-len",
        type=_positive_int32,
        default=None,
        help="longest sequence (default: 8192 for the built-in workload, else the longest "
        "request of the trace)",
    )
    p_sim.add_argument(
        "--tokens-per-block",
        type=_positive_int32,
        default=None,
        help=f"tokens per KV block (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    add_scheduler_option(p_sim)
    p_sim.add_argument(
        "--num-conversations",
        type=_int_in(1, _MAX_CONVERSATIONS, "the built-in workload is generated in memory"),
        default=None,
        metavar="N",
        help="conversations in the built-in workload, each 1-6 requests (default 400, "
        "about 1,000 requests)",
    )
    p_sim.add_argument("--num-requests", default=None, help=argparse.SUPPRESS)
    p_sim.add_argument(
        "--draft-tokens",
        type=_int_in(0, _MAX_DRAFT_TOKENS, "drafts are verified one position at a time"),
        default=0,
        help="draft tokens per generation step (speculative decoding; default 0)",
    )
    p_sim.add_argument(
        "--seed",
        type=_int_in(0, 2**63 - 1),
        default=None,
        help="seeds the built-in workload and the draft acceptance (default 0)",
    )
    p_sim.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int32,
        default=None,
        metavar="N",
        help="tokens per engine step: generation tokens and prefill chunks (default 8192)",
    )
    p_sim.add_argument(
        "--max-chunk-size",
        type=_positive_int32,
        default=None,
        metavar="N",
        help="most tokens of one prefill chunk (default: the step's token budget)",
    )
    p_sim.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill every prompt whole in one step (default: in chunks that fill the "
        "step's token budget)",
    )
    p_sim.add_argument("--no-reuse", action="store_true", help="disable block reuse")
    p_sim.add_argument(
        "--swa-reuse-policy",
        choices=["invalidate", "placeholder"],
        default="placeholder",
        help="reuse of sliding-window chains whose out-of-window blocks were reclaimed "
        "(default: placeholder)",
    )
    p_sim.add_argument(
        "--plain-lru",
        action="store_true",
        help="evict cached blocks in plain LRU order per priority instead of protecting blocks "
        "that served a reuse hit (protect_reused_blocks=False), to show the difference",
    )
    p_sim.add_argument(
        "--lend-free-memory",
        action="store_true",
        help="let the windows lend each other free memory at run time (lend_free_memory=True): "
        "the shares set the initial split only",
    )
    p_sim.add_argument(
        "--host-cache",
        type=size,
        default=None,
        metavar="SIZE",
        help="host (secondary) memory for offloaded reusable blocks, e.g. 8GiB (default: none)",
    )
    p_sim.add_argument(
        "--disk-cache",
        type=size,
        default=None,
        metavar="SIZE",
        help="disk tier below the host cache (needs --host-cache), e.g. 64GiB; the report "
        "shows the hit rate with and without it (default: none)",
    )
    p_sim.add_argument(
        "--num-beams",
        type=_int_in(1, 64, "beams are forks of one sequence"),
        default=1,
        metavar="K",
        help="also report the blocks per request of beam search with K beams: forked "
        "(fork_sequence, the prompt's blocks shared) against K separate sequences",
    )
    p_sim.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p_sim.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot pool use (needs matplotlib)"
    )
    p_sim.add_argument("--compare-shares", action="store_true", help="run under every share policy")
    p_sim.add_argument(
        "--engines",
        type=_int_in(1, _MAX_ENGINES, "each engine is a whole manager"),
        default=None,
        metavar="N",
        help="simulate a fleet of N engines behind --router (each with --memory; default 1)",
    )
    p_sim.add_argument(
        "--router",
        choices=["kv", "round-robin", "least-loaded"],  # kvcache.simulate.fleet.ROUTERS
        default=None,
        help="how a fleet of --engines routes requests: kv (an index fed by the engines' KV "
        "events; needs the events extra), round-robin or least-loaded (default: kv)",
    )
    p_sim.add_argument(
        "--compare-routers",
        action="store_true",
        help="run the fleet under every router and print one table (needs --engines 2+)",
    )
    p_sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_sim.set_defaults(func=_cmd_simulate)

    p_gen = sub.add_parser(
        "generate",
        help="greedy generation with a Hugging Face model on kvcache (needs the torch extra: "
        "pip install 'kvcache[torch]', or '.[torch]' in a checkout)",
    )
    add_arguments(p_gen, size, _positive_int32)
    p_gen.set_defaults(func=_cmd_generate)
    return parser


#: How kvcache.sizing names the field in its share errors; the command line names the flag.
_SHARES_FIELD = "KvCacheConfig.window_size_shares"


def _shares_text(shares: str | Sequence[float]) -> str:
    if isinstance(shares, str):
        return shares
    return ",".join(f"{s:g}" if float(f"{s:g}") == s else repr(s) for s in shares)


def _shares_notes(flag: str, shares: str | Sequence[float]) -> list[str]:
    """A warning when ``--shares`` numbers do not sum to 1: they are used as proportions."""
    if isinstance(shares, str):
        return []
    total = sum(Fraction(repr(s)) for s in shares)  # as kvcache.sizing reads them: exactly
    if total == 1:
        return []
    used = ", ".join(f"{float(Fraction(repr(s)) / total):.4g}" for s in shares)
    return [
        f"warning: {flag} sums to {float(total):g}, not 1: the shares are proportions, "
        f"normalised to {used}"
    ]


def _warning_printer(prog: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: ``PROG: warning: MESSAGE``."""

    def show(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        print(f"{prog}: warning: {message}", file=sys.stderr)

    return show


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    return first or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Runs the ``kvcache`` command line and returns the exit status.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success, 2 for a bad command line or input, 1 when the run itself failed,
        130 when interrupted, 141 when stdout was closed early. Errors print one line to
        stderr, never a traceback.
    """
    prog = _PROG  # "kvcache simulate" once the command is known, as argparse says it
    shares_flag = ""  # "--shares 0.2,0.3,0.5" when given: errors name it, not the field
    try:
        notes: list[str] = []
        parser = _build_parser(notes)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        prog = f"{_PROG} {args.command}"
        shares = getattr(args, "shares", None)
        if shares is not None:
            shares_flag = f"--shares {_shares_text(shares)}"
        for note in dict.fromkeys(notes):  # a default such as generate's 16MiB adds none
            print(f"{prog}: {note}", file=sys.stderr)
        with warnings.catch_warnings():
            # The library's warnings as the command's one-line warnings; simulate says what a
            # short --max-seq-len does to the windows itself.
            warnings.showwarning = _warning_printer(prog)
            if args.command == "simulate":
                warnings.filterwarnings("ignore", message="max_attention_window", module="kvcache")
            status = int(args.func(args))
        # After the run: a wrong share count is an error that says more.
        if shares is not None:
            for note in _shares_notes(shares_flag, shares):
                print(f"{prog}: {note}", file=sys.stderr)
        return status
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvcache models | head`: stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except (ValueError, OSError) as e:
        message = _one_line(e)
        if shares_flag and message.startswith(_SHARES_FIELD):
            message = shares_flag + message.removeprefix(_SHARES_FIELD)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # kvcache.KVCacheError and its subclasses
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        print(
            f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} (please report it)",
            file=sys.stderr,
        )
        return 1
