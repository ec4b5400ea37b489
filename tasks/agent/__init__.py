"""Agent episodes: what a user's episode function is handed, and how the scheduler runs it.

The public names, the only ones user code (``examples/``, a user's episode module) imports,
are listed in ``__all__``; the modules beneath are the implementation and may change.
"""

from asyncrl.tasks.agent.episode import EpisodeContext

__all__ = ["EpisodeContext"]
