"""The serving step: requests and batches, the capacity scheduler and the resource
manager an engine drives each step (estimates, step checks, forks of beam families)."""
