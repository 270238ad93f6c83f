"""What the benchmark's two modes share: the SSE reader, percentiles, the table layout."""
from __future__ import annotations

import json
from typing import AsyncIterator, Optional

import httpx

WORDS = ("river stone lantern orbit maple copper signal harbor meadow thunder velvet quartz falcon ember "
         "glacier prism tundra compass saffron willow beacon canyon nectar cobalt lagoon summit ripple "
         "garnet pylon harvest juniper vortex").split()


def percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


class StreamError(Exception):
    """A streamed answer that failed: a status other than 200, or an error event."""


async def stream_chunks(client: httpx.AsyncClient, url: str, path: str, body: dict) -> AsyncIterator[dict]:
    """The JSON chunks of a streamed answer, up to `data: [DONE]`. Raises StreamError."""
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(chunk["error"].get("message", "error event"))
            yield chunk


def failure(e: Exception) -> str:
    return str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"


def ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def text_table(columns: list[tuple[str, int]], rows: list[list[str]], note: str) -> str:
    """Right-aligned columns (name, width) under a rule, then the note."""
    head = " ".join(f"{name:>{w}}" for name, w in columns)
    body = [" ".join(f"{cell:>{w}}" for cell, (_, w) in zip(row, columns)) for row in rows]
    return "\n".join([head, "-" * len(head), *body, note])
