"""Paged decode state: the page layout, the page pool and per-slot block tables."""
from .blocks import BlockManager
from .layout import PageLayout
from .pool import PageHandle, PagePool, PoolError, PoolExhausted, StaleHandle, pages_for_tokens, pool_pages

__all__ = ["BlockManager", "PageLayout", "PageHandle", "PagePool", "PoolError", "PoolExhausted",
           "StaleHandle", "pages_for_tokens", "pool_pages"]
