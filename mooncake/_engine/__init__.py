"""Async drivers (anyio): the engine, its transports and metadata backends."""
