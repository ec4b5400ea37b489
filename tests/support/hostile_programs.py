"""Hostile programs shared by the sandbox tests."""

from __future__ import annotations

# A fork bomb of sleeping children: it prints how many forks worked (the process cap made visible).
SLEEPER_BOMB = (
    "import os, time\n"
    "n = 0\n"
    "for _ in range(200):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    n += 1\n"
    "print(n)\n"
)
