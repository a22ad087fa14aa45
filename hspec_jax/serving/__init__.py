"""Serving: a paged KV pool (pages, page tables, allocator) and continuous batching over it (`engine.py`)."""

from hspec_jax.serving.allocator import PageAllocator, pages_for
from hspec_jax.serving.engine import Completion, Request, ServingConfig, ServingEngine, engine_costs
from hspec_jax.serving.paged import NULL_PAGE, PagedBuffers, PagedKVCache, page_bytes, paged_cache, paged_context

__all__ = [
    "NULL_PAGE",
    "Completion",
    "PageAllocator",
    "PagedBuffers",
    "PagedKVCache",
    "Request",
    "ServingConfig",
    "ServingEngine",
    "engine_costs",
    "page_bytes",
    "paged_cache",
    "paged_context",
    "pages_for",
]
