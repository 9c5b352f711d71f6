"""Moved to `diloco.core.progress` (the learner core owns it); this name stays for the simulator until it runs on
`diloco.core.learner.LearnerCore`."""

from diloco.core.progress import ReadProgress

__all__ = ["ReadProgress"]
