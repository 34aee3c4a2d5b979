"""Where the seconds before the first optimizer step go: the startup summary's "ready in" line and the
`startup_s` of metrics.jsonl's start record (docs/watching.md). Plain wall-clock marks, no dependencies."""

from __future__ import annotations

import time

from gpupoor.process import from_command_line, process_age_s, started_by_command_line  # noqa: F401 -- the clock reads the first two; cli.py calls the third here


class StartupClock:
    """Seconds per start-up part, in order. From the command line, the first part ("python and cli": the
    interpreter, the command line, the recipe's checks and memory plan) runs from the process's start to the
    clock's creation."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        age = process_age_s() if from_command_line() else None
        if age is not None:
            self.parts["python and cli"] = age
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        """The time since the previous mark belongs to `part` (added up when a part is marked twice)."""
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        return {part: round(seconds, 3) for part, seconds in self.parts.items()}

    def line(self) -> str:
        total = sum(self.parts.values())
        return f"ready in {total:.1f} s (" + ", ".join(f"{part} {s:.2f}" for part, s in self.parts.items()) + ")"
