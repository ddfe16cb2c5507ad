"""What an optional extra's missing import says: which extra, and how to install it.

``import kvcache`` needs numpy only; the extras add pure-Python packages (``torch`` adds torch
and transformers, ``events`` pyzmq and msgspec, ``redis`` the redis client). A module that
needs one imports it through :func:`missing_extra`, so a user without it reads the command
that installs it (for a package index and for a source checkout) instead of a bare
``ModuleNotFoundError``.
"""

from __future__ import annotations

#: extra -> the packages it adds (pyproject.toml's ``[project.optional-dependencies]``).
EXTRA_PACKAGES = {
    "torch": ("torch", "transformers"),
    "events": ("pyzmq", "msgspec"),
    "redis": ("redis",),
    "plot": ("matplotlib",),
}


#: Where CPU-only builds of torch come from (PyPI's Linux torch is the CUDA build).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def install_hint(extra: str) -> str:
    """``pip install 'kvcache[EXTRA]'`` and its spelling in a source checkout."""
    hint = (
        f"pip install 'kvcache[{extra}]' (in a source checkout: pip install '.[{extra}]' in "
        f"its root, or just the packages: pip install {' '.join(EXTRA_PACKAGES[extra])})"
    )
    if extra == "torch":
        hint += f"; without a GPU, CPU torch first: pip install torch --index-url {TORCH_CPU_INDEX}"
    return hint


def missing_extra(module: str, extra: str, error: ImportError) -> ModuleNotFoundError:
    """The error ``module`` raises when an import of ``extra``'s packages failed.

    A ``ModuleNotFoundError`` (so ``except ImportError`` still catches it) naming the
    module, the extra, the install command and the import that failed.
    """
    packages = " and ".join(EXTRA_PACKAGES[extra])
    return ModuleNotFoundError(
        f"{module} needs the {extra} extra ({packages}): {install_hint(extra)}; the import "
        f"failed with: {error}",
        name=error.name,
    )
