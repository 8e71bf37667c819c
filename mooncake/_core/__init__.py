"""Sans-I/O core: wire codecs, descriptors, the memory registry, slicing.

Pure Python. Nothing under this package imports anyio, trio or asyncio (a test checks it): it is
fed bytes and returns values or raises :class:`mooncake.errors.ProtocolError`.
"""
