"""Session-wide settings for the test suite."""

from __future__ import annotations

import os

# Prefect must not try to reach its telemetry service from an offline machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
