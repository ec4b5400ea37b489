"""Hostile programs shared by the sandbox tests."""

from __future__ import annotations

def sleeper_bomb(linger_s: float = 0.0) -> str:
    """A fork bomb of sleeping children: it prints how many forks worked (the process cap made
    visible), after holding its children ``linger_s`` seconds more (so two bombs overlap)."""
    linger = f"time.sleep({linger_s})\n" if linger_s else ""
    return (
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
        f"{linger}"
        "print(n)\n"
    )


SLEEPER_BOMB = sleeper_bomb()
