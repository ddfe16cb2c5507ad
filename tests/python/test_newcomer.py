"""Issue 37's newcomer list: what a new user meets first, one test per fixed item.

The command-line tests run ``kvcache`` in a subprocess as a user would (test_cli.py's helpers)
and check the exact line printed and the exit status; the API tests check the exact message,
warning or block ids.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli import _env, assert_usage_error, kvcache_run

import kvcache
from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.sizing import SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR

#: A built-in workload of 4 requests (seed 0) that runs in well under a second.
TINY = ["--model", "gemma-3-1b", "--memory", "512MiB", "--num-conversations", "2"]
QUIET = [*TINY, "--no-progress"]
PROG = "kvcache simulate"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


def _help(command: str) -> list[str]:
    """``kvcache COMMAND --help`` unwrapped (one line per paragraph)."""
    proc = kvcache_run(command, "--help", env=_env(COLUMNS="1000"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines()


def _option_help(lines: list[str], option: str) -> str:
    """The help text of ``option`` (on its line, or on the next when the option is long)."""
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith(option + " "))
    text = lines[i].strip().split("  ", 1)
    return text[1].strip() if len(text) == 2 else lines[i + 1].strip()


# --- --help: description lines, shown defaults, one name for the scheduler option ---------


def test_simulate_help_has_a_description_and_defaults() -> None:
    lines = _help("simulate")
    assert lines[2] == (
        "Replay a workload (the built-in multi-turn chat, or a kvcache or Mooncake trace) "
        "through the manager on the virtual backend, no GPU needed, and report each window's "
        "pool use, concurrency, the prefix hit rate against the trace's ideal, and the "
        "manager's time per step; one engine, or a fleet behind a router."
    )
    assert lines[-1] == "Example: kvcache simulate --model gemma-3-12b --memory 24GiB --shares auto"
    assert _option_help(lines, "--max-batch-size") == "most requests running at once (default 128)"
    assert _option_help(lines, "--tokens-per-block") == "tokens per KV block (default 32)"
    assert _option_help(lines, "--scheduler").endswith("(default: max_utilization)")


def test_simulate_help_defaults_are_the_defaults_used() -> None:
    from kvcache.cli.plan import DEFAULT_TOKENS_PER_BLOCK
    from kvcache.simulate import DEFAULT_MAX_BATCH_SIZE

    assert (DEFAULT_MAX_BATCH_SIZE, DEFAULT_TOKENS_PER_BLOCK) == (128, 32)


def test_plan_help_has_a_description_and_defaults() -> None:
    lines = _help("plan")
    assert lines[2] == (
        "Plan a KV memory budget for a model: the blocks, tokens and concurrent sequences of "
        "every attention window under each share policy (equal, proportional, auto), before "
        "anything is allocated."
    )
    assert lines[-1] == (
        "Example: kvcache plan --model gemma-3-27b --memory 80GiB --max-seq-len 32768"
    )
    assert _option_help(lines, "--tokens-per-block") == "tokens per KV block (default 32)"
    assert _option_help(lines, "--max-draft-tokens").endswith("(default 0)")


def test_generate_help_says_scheduler_and_memory_default() -> None:
    lines = _help("generate")
    text = "\n".join(lines)
    assert "[--scheduler {guaranteed_no_evict,max_utilization}]" in lines[0]
    assert _option_help(lines, "--scheduler").startswith(
        "the scheduler's policy, CapacityScheduler(policy=...): guaranteed_no_evict"
    )
    assert "--policy" not in text  # the old name is a hidden alias
    assert _option_help(lines, "--memory") == "primary KV budget (default: 16MiB)"


def test_generate_policy_is_a_hidden_alias_of_scheduler() -> None:
    from kvcache.cli.commands import _build_parser

    parser = _build_parser()
    assert parser.parse_args(["generate"]).scheduler == "max_utilization"
    for flag in ("--scheduler", "--policy"):
        args = parser.parse_args(["generate", flag, "guaranteed_no_evict"])
        assert args.scheduler == "guaranteed_no_evict"
        assert not hasattr(args, "policy")
    assert parser.parse_args(["simulate", "--policy", "guaranteed_no_evict"]).scheduler == (
        "guaranteed_no_evict"
    )


# --- missing extras ------------------------------------------------------------------------

_EVENTS_HINT = (
    "pip install 'kvcache[events]' (in a source checkout: pip install '.[events]' in its "
    "root, or just the packages: pip install pyzmq msgspec)"
)
_TORCH_HINT = (
    "pip install 'kvcache[torch]' (in a source checkout: pip install '.[torch]' in its root, "
    "or just the packages: pip install torch transformers); without a GPU, CPU torch first: "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu"
)


@pytest.fixture
def block_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Top-level packages added to the returned set fail to import, as if not installed."""
    blocked: set[str] = set()
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    yield blocked


def _import_fresh(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Imports ``module`` again, and the room's module its documented path names
    (``kvcache.engine`` is ``kvcache.reference.engine``), whichever was imported."""
    last = module.rpartition(".")[2]
    for name in list(sys.modules):
        if name == module or (name.count(".") == 2 and name.rpartition(".")[2] == last):
            monkeypatch.delitem(sys.modules, name)  # restored after the test
    importlib.import_module(module)


def test_events_without_the_extra_names_both_install_commands(
    monkeypatch: pytest.MonkeyPatch, block_imports: set[str]
) -> None:
    block_imports.update({"zmq", "msgspec"})
    with pytest.raises(ModuleNotFoundError) as info:
        _import_fresh(monkeypatch, "kvcache.events")
    assert str(info.value) == (
        f"kvcache.events needs the events extra (pyzmq and msgspec): {_EVENTS_HINT}; the "
        "import failed with: No module named 'msgspec'"
    )
    assert info.value.name == "msgspec"
    assert info.value.__suppress_context__  # no second traceback of the raw import


@pytest.mark.parametrize("module", ["kvcache.engine", "kvcache.torch", "kvcache.beam_search"])
def test_torch_modules_without_torch_name_the_cpu_index(
    monkeypatch: pytest.MonkeyPatch, block_imports: set[str], module: str
) -> None:
    block_imports.add("torch")
    with pytest.raises(ModuleNotFoundError) as info:
        _import_fresh(monkeypatch, module)
    assert str(info.value) == (
        f"{module} needs the torch extra (torch and transformers): {_TORCH_HINT}; the import "
        "failed with: No module named 'torch'"
    )
    assert info.value.name == "torch"


def test_engine_without_transformers_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch: without it the torch import fails first")
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "transformers" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError) as info:
        _import_fresh(monkeypatch, "kvcache.engine")
    assert str(info.value) == (
        f"kvcache.engine needs the torch extra (torch and transformers): {_TORCH_HINT}; the "
        "import failed with: No module named 'transformers'"
    )


_NO_EVENTS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zmq", "msgspec"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _Block())
from kvcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _simulate_without_events(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvcache simulate ARGS`` where pyzmq and msgspec cannot be imported."""
    command = [sys.executable, "-c", _NO_EVENTS, "simulate", *QUIET, *args]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=60)


@pytest.mark.parametrize(
    ("args", "which"),
    [
        (
            ["--engines", "2", "--compare-routers"],
            "--compare-routers runs the kv router too, which",
        ),
        (["--engines", "2"], "--router kv (the default router of --engines)"),
    ],
)
def test_fleet_without_the_events_extra_says_what_needs_it(args: list[str], which: str) -> None:
    line = assert_usage_error(_simulate_without_events(*args))
    assert line == f"{PROG}: error: {which} needs the events extra: {_EVENTS_HINT}"


def test_fleet_without_the_events_extra_runs_other_routers() -> None:
    proc = _simulate_without_events("--engines", "2", "--router", "round-robin")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{PROG}: 2 engines, round-robin router; each gemma-3-1b")


# --- simulate: an empty workload, --router without a fleet, --shares ------------------------


def test_short_max_seq_len_says_why_the_workload_is_empty_and_what_works() -> None:
    line = assert_usage_error(kvcache_run("simulate", *QUIET, "--max-seq-len", "512"))
    assert line == (
        f"{PROG}: error: --max-seq-len 512 leaves the built-in workload empty: a conversation "
        "ends at its first turn longer than the limit, and every first turn (a system prompt "
        "of 200-2,000 tokens, a question and an answer) is longer than 512 tokens; give "
        "--max-seq-len 867 or more (the default 8,192 keeps 4 requests), or replay your own "
        "requests with --trace FILE"
    )
    # 867 is the smallest that works: 866 is empty too and names the same fix.
    line = assert_usage_error(kvcache_run("simulate", *QUIET, "--max-seq-len", "866"))
    assert "give --max-seq-len 867 or more" in line
    ok = kvcache_run("simulate", *QUIET, "--max-seq-len", "867")
    assert ok.returncode == 0, ok.stderr
    assert "  workload: built-in multi-turn chat, 2 conversations (seed 0): 1 request" in ok.stdout


@pytest.mark.parametrize("router", ["kv", "round-robin", "least-loaded"])
def test_router_without_engines_is_a_usage_error(router: str) -> None:
    line = assert_usage_error(kvcache_run("simulate", *QUIET, "--router", router))
    assert line == (
        f"{PROG}: error: --router {router} routes the requests of a fleet; give --engines N "
        "(2 or more) to simulate N engines behind it"
    )


def test_router_with_one_engine_warns_and_runs_one_engine() -> None:
    proc = kvcache_run("simulate", *QUIET, "--engines", "1", "--router", "kv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{PROG}: warning: --router kv with --engines 1: every request goes to the one "
        "engine, so the router changes nothing"
    ]
    assert proc.stdout.startswith(f"{PROG}: gemma-3-1b, 512 MiB primary KV memory")  # no fleet


def test_a_wrong_share_count_names_the_flag_typed() -> None:
    line = assert_usage_error(kvcache_run("simulate", *QUIET, "--shares", "0.2,0.3,0.5"))
    assert line == (
        f"{PROG}: error: --shares 0.2,0.3,0.5 gives 3 share(s) but the model has 2 window(s) "
        "[512, 8192]; give one share per window in ascending window order"
    )
    line = assert_usage_error(
        kvcache_run("plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--shares", "1,2,3")
    )
    assert line == (
        "kvcache plan: error: --shares 1,2,3 gives 3 share(s) but the model has 2 window(s) "
        "[512, 32768]; give one share per window in ascending window order"
    )


@pytest.mark.parametrize(
    ("shares", "total", "used"), [("1,3", "4", "0.25, 0.75"), ("0.2,0.2", "0.4", "0.5, 0.5")]
)
def test_shares_that_do_not_sum_to_one_are_normalised_with_a_warning(
    shares: str, total: str, used: str
) -> None:
    proc = kvcache_run("simulate", *QUIET, "--shares", shares)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{PROG}: warning: --shares {shares} sums to {total}, not 1: the shares are "
        f"proportions, normalised to {used}"
    ]
    assert f"{shares} window shares" in proc.stdout.splitlines()[0]


def test_shares_that_sum_to_one_say_nothing() -> None:
    proc = kvcache_run("simulate", *QUIET, "--shares", "0.25,0.75")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# --- traces with unknown keys ---------------------------------------------------------------


def test_a_trace_line_with_unknown_keys_lists_both_formats(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"request_id": 1, "arrival": 0, "prompt": [1], "output": [2], "x": 1}\n')
    line = assert_usage_error(kvcache_run("simulate", "--trace", str(path)))
    assert line == (
        f"{PROG}: error: {path}:1: unknown key(s) 'x'; a line of kvcache's format has "
        "request_id, arrival, prompt, output (optional: lora_task_id, cache_salt, priority); "
        "one of Mooncake's has timestamp, input_length, output_length, hash_ids; see "
        '"Trace format" in docs/api.md'
    )


def test_a_mooncake_line_with_unknown_keys_lists_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0], "foo": 1}\n'
    )
    line = assert_usage_error(kvcache_run("simulate", "--trace", str(path)))
    assert line == (
        f"{PROG}: error: {path}:1: unknown key(s) 'foo' in a Mooncake line, which has exactly "
        'timestamp, input_length, output_length, hash_ids; see "Trace format" in docs/api.md'
    )


def test_the_trace_format_section_the_errors_name_exists() -> None:
    api = Path(__file__).resolve().parents[2] / "docs" / "api.md"
    if not api.exists():
        pytest.skip("not run from a source checkout")
    assert "\n## Trace format\n" in api.read_text(encoding="utf-8")


# --- the API --------------------------------------------------------------------------------

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)


def _two_window_manager() -> KVCacheManager:
    """README's example: windows 8 and full (64), 4-token blocks, 12 tokens of request 1."""
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    m = KVCacheManager.from_blocks(MODEL, config, {8: 4, 64: 8}, max_seq_len=64, max_batch_size=2)
    m.add_sequence(1, list(range(10)))
    m.add_tokens([1], [10])
    m.add_tokens([1], [11])
    return m


def test_get_cache_block_ids_of_none_or_full_is_full_attention() -> None:
    m = _two_window_manager()
    assert m.window_sizes == [8, 64]
    assert m.get_cache_block_ids(1, 8) == [kvcache.NULL_BLOCK, 1, 2]  # the window released 0
    assert m.get_cache_block_ids(1, 64) == [0, 1, 2]
    assert m.get_cache_block_ids(1, None) == [0, 1, 2]
    assert m.get_cache_block_ids(1, "full") == [0, 1, 2]
    with pytest.raises(ValueError) as info:
        m.get_cache_block_ids(1, "half")
    assert str(info.value) == (
        'window_size must be one of this manager\'s windows [8, 64], or None / "full" for '
        "full attention; got 'half'"
    )


def test_get_cache_block_ids_full_without_a_full_window_says_so() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, 16], backend="virtual")
    m = KVCacheManager.from_blocks(MODEL, config, {8: 4, 16: 8}, max_seq_len=64, max_batch_size=2)
    m.add_sequence(1, list(range(10)))
    with pytest.raises(ValueError) as info:
        m.get_cache_block_ids(1, "full")
    assert str(info.value) == (
        "window_size 'full' means full attention, but this manager has no full-attention "
        "window: its windows [8, 16] are all sliding (shorter than max_seq_len 64); give one "
        "of them"
    )


def test_a_size_string_for_primary_bytes_points_to_parse_size() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    with pytest.raises(ValueError) as info:
        KVCacheManager(MODEL, config, max_seq_len=64, max_batch_size=2, primary_bytes="4GiB")  # type: ignore[arg-type]
    assert str(info.value) == (
        "primary_bytes must be a positive int (bytes), got '4GiB'; for a size string pass "
        "kvcache.parse_size('4GiB')"
    )
    # What the hint says works.
    m = KVCacheManager(
        MODEL, config, max_seq_len=64, max_batch_size=2, primary_bytes=kvcache.parse_size("1MiB")
    )
    assert m.window_sizes == [8, 64]


@pytest.mark.parametrize("field", ["max_gpu_total_bytes", "host_cache_size", "disk_cache_size"])
def test_a_size_string_for_a_config_byte_count_points_to_parse_size(field: str) -> None:
    with pytest.raises(ValueError) as info:
        KvCacheConfig(**{field: "4GiB"})  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{field} must be a non-negative int (bytes), got '4GiB'; for a size string pass "
        "kvcache.parse_size('4GiB')"
    )


@pytest.mark.parametrize("constructor", ["from_blocks", "__init__"])
def test_a_window_not_shorter_than_max_seq_len_warns(constructor: str) -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[64, None], backend="virtual")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if constructor == "from_blocks":
            m = KVCacheManager.from_blocks(MODEL, config, {32: 8}, max_seq_len=32, max_batch_size=2)
        else:
            m = KVCacheManager(MODEL, config, max_seq_len=32, max_batch_size=2, primary_bytes=2**20)
    assert m.window_sizes == [32]
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            UserWarning,
            "max_attention_window 64 is not shorter than max_seq_len 32: those layers run as "
            "full attention, so the manager has 1 window(s) [32] instead of 2",
        )
    ]
    assert caught[0].filename == __file__  # reported at the caller's line


def test_windows_shorter_than_max_seq_len_do_not_warn() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVCacheManager.from_blocks(MODEL, config, {8: 4, 64: 8}, max_seq_len=64, max_batch_size=2)


def test_dir_of_the_package_is_its_public_api() -> None:
    names = dir(kvcache)
    assert "annotations" not in names
    assert not hasattr(kvcache, "annotations")
    for internal in ("_core", "config", "fields", "manager"):
        assert internal not in names, internal
    assert set(kvcache.__all__) <= set(names)
    importlib.import_module("kvcache.simulate")
    assert "simulate" in dir(kvcache)


# --- fleet tables: the latency unit ---------------------------------------------------------


def test_compare_routers_gives_mean_latency_in_steps() -> None:
    if importlib.util.find_spec("zmq") is None or importlib.util.find_spec("msgspec") is None:
        pytest.skip("--compare-routers needs the events extra")
    proc = kvcache_run("simulate", *QUIET, "--engines", "2", "--compare-routers")
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if "latency" in line]
    assert row.split()[:3] == ["mean", "latency", "(steps)"]
    assert len(row.split()) == 6  # and one value per router


def test_fleet_engine_table_gives_mean_latency_in_steps() -> None:
    proc = kvcache_run("simulate", *QUIET, "--engines", "2", "--router", "round-robin")
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("engine"))
    assert header.split("  ")[-1].strip() == "mean latency (steps)"


def test_one_request_is_singular() -> None:
    proc = kvcache_run("simulate", *QUIET, "--max-seq-len", "1100", "--num-conversations", "1")
    assert proc.returncode == 0, proc.stderr
    assert (
        "  workload: built-in multi-turn chat, 1 conversation (seed 0): 1 request, one per turn"
        in proc.stdout.splitlines()
    )
    assert proc.stderr.splitlines()[0] == (
        "kvcache simulate: warning: --max-seq-len 1,100 ends conversations early: the built-in "
        "workload has 1 request instead of 3 at the default 8,192 (a conversation ends at its "
        "first turn over the limit)"
    )
