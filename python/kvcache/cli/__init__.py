"""The command line: ``kvcache models``, ``plan`` (:mod:`kvcache.cli.plan`), ``simulate``
(:mod:`kvcache.simulate.command`) and ``generate`` (:mod:`kvcache.cli.generate`; the engine
itself needs the ``torch`` extra, its options do not). :func:`main` is the console script,
also run as ``python -m kvcache.cli``."""

from kvcache.cli.commands import MAX_SIZE_BYTES, PlanRow, PolicyPlan, main, make_plan

__all__ = ["MAX_SIZE_BYTES", "PlanRow", "PolicyPlan", "main", "make_plan"]
