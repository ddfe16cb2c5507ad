"""The README works as written, the docs link only inside the repository and cover the API.

The README's and docs/api.md's ``python`` blocks are complete programs: each one runs here in
a fresh namespace. Links must name files of this repository (a clone has nothing else).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import kvcache
from kvcache.cli import main
from kvcache.sizing import SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"
DOCS = [README, API, ROOT / "bench" / "README.md", ROOT / "docs" / "design.md"]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")

pytestmark = pytest.mark.skipif(not README.exists(), reason="not run from a source checkout")


def _blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of language ``lang`` in ``path``."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(2))
        for m in _FENCE.finditer(text)
        if m.group(1) == lang
    ]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


@pytest.mark.parametrize(
    ("path", "line", "code"),
    [
        pytest.param(path, line, code, id=f"{path.name}:{line}")
        for path in (README, API)
        if path.exists()
        for line, code in _blocks(path, "python")
    ],
)
def test_python_blocks_run(path: Path, line: int, code: str) -> None:
    """Each block is a whole program: no names from elsewhere, no errors."""
    if "kvcache.engine" in code or "kvcache.torch" in code:
        for extra in ("torch", "transformers"):
            if importlib.util.find_spec(extra) is None:
                pytest.skip(f"needs {extra} (the torch extra)")
    exec(compile(code, f"{path.name}:{line}", "exec"), {"__name__": "__readme__"})


def test_readme_using_it_is_a_program() -> None:
    using = README.read_text(encoding="utf-8").split("## Using it", 1)[1].split("\n## ", 1)[0]
    assert "```python" in using
    # The offset table's shape is explained next to the call.
    assert "int32 [pools, rows, kv, width]" in using


def test_readme_has_exactly_the_two_setup_commands() -> None:
    assert [code.strip() for _, code in _blocks(README, "bash")] == [
        "pip install . && kvcache simulate",
        "bash .ci/run",
    ]
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    # What a fresh machine needs, and how long it takes.
    for needed in (
        "python3 -m venv",
        "externally-managed-environment",
        "C++17 compiler",
        "python3-dev",
        "root",
        "package index",
        "minutes",
        "pip install --no-build-isolation .",
        "'.[plot]'",
    ):
        assert needed in quick, needed


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if d.exists()], ids=lambda d: str(d.relative_to(ROOT))
)
def test_links_stay_inside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert "shared/" not in text
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        file = (doc.parent / target.split("#", 1)[0]).resolve()
        assert file.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert file.exists(), f"{doc.name} links to a missing file: {target}"


def test_api_reference_covers_the_public_api(capsys: pytest.CaptureFixture[str]) -> None:
    api = API.read_text(encoding="utf-8")
    names: set[str] = set(kvcache.__all__) - {"__version__"}
    names |= {f.name for f in dataclasses.fields(kvcache.KvCacheConfig)}
    names |= {f.name for f in dataclasses.fields(kvcache.ModelConfig)}
    names |= {f.name for f in dataclasses.fields(kvcache.KvCacheStats)}
    names |= {n for n in dir(kvcache.KVCacheManager) if not n.startswith("_")}
    names |= {n for n in dir(kvcache.KVCacheResourceManager) if not n.startswith("_")}
    names |= {"KVCACHE_WINDOW_SIZE_SHARES", "TRTLLM_WINDOW_SIZE_SHARES", "available_memory_bytes"}
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        engine = importlib.import_module("kvcache.engine")
        kv_torch = importlib.import_module("kvcache.torch")
        names |= set(kv_torch.__all__) | set(engine.__all__)
        names |= {n for n in dir(engine.Engine) if not n.startswith("_")}
        names |= {f.name for f in dataclasses.fields(engine.EngineStats)}
        names |= {f.name for f in dataclasses.fields(engine.GenerationResult)}
    missing = sorted(n for n in names if f"`{n}" not in api and f"{n}(" not in api)
    assert not missing, f"docs/api.md does not mention {missing}"
    for command in ("models", "plan", "simulate", "generate"):
        assert main([command, "--help"]) == 0
        options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", capsys.readouterr().out))
        options -= {"--help"}
        undocumented = sorted(o for o in options if f"`{o}" not in api)
        assert not undocumented, f"docs/api.md does not document {command} {undocumented}"


def test_host_backend_default_budget_is_modest() -> None:
    """Without a GPU, "size from free memory" takes half the available RAM, at most 4 GiB."""
    available = kvcache.available_memory_bytes("host")
    assert 0 < available <= 4 * 2**30
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        line = next(x for x in meminfo.read_text().splitlines() if x.startswith("MemAvailable:"))
        mem_available = int(line.split()[1]) * 1024
        assert available <= mem_available * 0.55  # half of it, give or take what changed
    model = kvcache.ModelConfig(num_layers=1, num_kv_heads=8, head_dim=128)
    config = kvcache.KvCacheConfig(backend="host")
    kv = kvcache.KVCacheManager(model, config, max_seq_len=4096, max_batch_size=1)
    pool_bytes = sum(p["block_bytes"] * p["num_primary_blocks"] for p in kv.pools)
    assert pool_bytes <= 0.9 * 4 * 2**30
