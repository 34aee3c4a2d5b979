"""Whether the model hub can be reached, asked once per process before the first hub id is resolved. With no
network, huggingface_hub retries each request five times with back-off (about 50 s, ten lines of retries) before
failing. gpupoor asks once instead (a name lookup and a TCP connect to the hub's host, a few seconds at most) and,
when the hub cannot be reached, puts huggingface_hub in offline mode for the rest of the process: a model in the
local cache loads at once, and one that is not fails at once, in one line that says so."""

from __future__ import annotations

import functools
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from gpupoor.errors import UserError

PROBE_SECONDS = 3.0
_went_offline = False  # gpupoor set HF_HUB_OFFLINE itself, because the hub could not be reached


def _offline_already() -> bool:
    import huggingface_hub.constants as constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def hub_host() -> tuple[str, int]:
    import huggingface_hub.constants as constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


@functools.cache
def hub_reachable() -> bool:
    """A TCP connection to the hub's host opens within PROBE_SECONDS (the name lookup included: it runs in a
    thread, since getaddrinfo takes no timeout)."""
    if _offline_already():
        return False
    host, port = hub_host()
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
            opened.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(PROBE_SECONDS + 1)
    return bool(opened)


def require_hub_model(name: str, key: str, revision: str | None = None) -> None:
    """Before `name` (a hub id) is read: with no hub to reach, huggingface_hub goes offline, and a model that is
    not in the local cache is a UserError naming it and what to do."""
    import huggingface_hub.constants as constants
    from huggingface_hub import try_to_load_from_cache

    global _went_offline
    if hub_reachable():
        return
    if not _offline_already():  # gpupoor goes offline itself: the hub cannot be reached
        constants.HF_HUB_OFFLINE = True  # read by huggingface_hub at each request: cached files, no retries
        os.environ["HF_HUB_OFFLINE"] = "1"  # for processes this one starts, and code that reads the variable
        _went_offline = True
    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:  # a malformed id: not cached either
        cached = None
    if not isinstance(cached, str):
        raise UserError(f"{key}: {name!r} is a hub id, it is not in this machine's hub cache, and {offline_cause()}",
                        hint=f"download it where there is a network (hf download {name}) and copy the cache "
                        f"({Path(constants.HF_HUB_CACHE)}), or set {key} to a local model directory or .gguf file")


def offline_cause() -> str:
    """Why a file not in the hub cache cannot be fetched: the user's HF_HUB_OFFLINE, or no network."""
    if not _went_offline and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE=1 is set"
    return f"{hub_host()[0]} cannot be reached from here (no network)"
