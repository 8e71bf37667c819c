"""How SGLang 0.5.23's Mooncake modules are made importable on a CPU-only torch.

Used by ``sglang_hicache.py`` and ``sglang_pd.py`` (run with the venv of
``scripts/integration-sglang.sh``). What is *not* SGLang's own code, exactly:

1. ``sglang/__init__.py`` is not run: ``sglang`` is put in ``sys.modules`` as a bare package
   whose ``__path__`` is the installed one, so ``sglang.srt.*`` submodules load from SGLang's own
   files. That ``__init__`` imports the frontend language API and applies ``transformers``
   patches (``sglang/__init__.py`` lines 21-40), none of which the Mooncake modules use.
2. Three modules are replaced in ``sys.modules`` because the Mooncake store module uses them only
   as a base class or a type, and their real import chain needs ``transformers`` and GPU
   kernels (``pool_host/group.py`` -> ``memory_pool.py:58`` -> ``sglang.srt.configs`` ->
   ``transformers``: ``ModuleNotFoundError: No module named 'transformers'``):

   * ``sglang.srt.mem_cache.pool_host``: ``HostKVCache`` (a type annotation of
     ``MooncakeStore.__init__``/``register_mem_pool_host``) and ``HostTensorAllocator`` (the
     base class of ``MooncakeHostTensorAllocator``);
   * ``sglang.srt.mem_cache.pool_host.mla``: ``MLATokenToKVPoolHost`` (``isinstance`` checks of
     draft pools only);
   * ``sglang.srt.observability.metrics_collector``: ``StorageMetrics`` (constructed by
     ``get_stats`` only, which the drivers do not call).

3. The host KV pools are not SGLang's classes (their modules are behind the same chain), but
   their ``get_page_buffer_meta`` (and MLA's ``_storage_page_index``) *are* SGLang's own code:
   the method bodies are read from ``pool_host/mha.py`` (``MHATokenToKVPoolHost``) and
   ``pool_host/mla.py`` (``MLATokenToKVPoolHost``) with ``ast`` and compiled onto small classes
   that hold the attributes those methods read (``kv_buffer``, ``layout``, ``page_size``,
   ``layer_num``, ``size``, ``head_num``/``head_dim`` or ``kv_cache_dim``, ``dtype``), laid out
   as the real ``init_kv_buffer`` lays them (MHA ``(2, size, layer_num, head_num, head_dim)``
   for ``page_first``; MLA ``(layer_num, size, 1, kv_cache_dim)`` for ``layer_first``).

``triton`` (imported at module level by ``sglang/srt/utils/common.py:91``) is the real wheel,
installed with ``--no-deps``: it imports without a GPU.
"""

from __future__ import annotations

import ast
import site
import sys
import types
from pathlib import Path
from typing import Any


def sglang_root() -> Path:
    for d in site.getsitepackages():
        p = Path(d) / "sglang"
        if (p / "srt").is_dir():
            return p
    raise SystemExit(
        "sglang is not installed in this interpreter (see scripts/integration-sglang.sh)"
    )


def install() -> Path:
    """Puts the bare ``sglang`` package and the three type-only stubs in ``sys.modules``."""
    root = sglang_root()
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(root)]
    sys.modules.setdefault("sglang", pkg)

    class HostKVCache:  # a type only
        pass

    class HostTensorAllocator:  # a base class only
        def __init__(self) -> None:
            pass

    class MLATokenToKVPoolHost(HostKVCache):  # isinstance only
        pass

    class StorageMetrics:  # built by get_stats only
        pass

    ph = types.ModuleType("sglang.srt.mem_cache.pool_host")
    ph.__path__ = [str(root / "srt/mem_cache/pool_host")]
    ph.HostKVCache = HostKVCache  # type: ignore[attr-defined]
    ph.HostTensorAllocator = HostTensorAllocator  # type: ignore[attr-defined]
    mla = types.ModuleType("sglang.srt.mem_cache.pool_host.mla")
    mla.MLATokenToKVPoolHost = MLATokenToKVPoolHost  # type: ignore[attr-defined]
    mc = types.ModuleType("sglang.srt.observability.metrics_collector")
    mc.StorageMetrics = StorageMetrics  # type: ignore[attr-defined]
    sys.modules["sglang.srt.mem_cache.pool_host"] = ph
    sys.modules["sglang.srt.mem_cache.pool_host.mla"] = mla
    sys.modules["sglang.srt.observability.metrics_collector"] = mc
    return root


def sglang_methods(path: Path, cls: str, names: tuple[str, ...]) -> dict[str, Any]:
    """SGLang's own method bodies ``names`` of class ``cls`` in ``path``, compiled as functions."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            funcs = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in names]
            missing = set(names) - {f.name for f in funcs}
            if missing:
                raise SystemExit(f"{path}: class {cls} has no {sorted(missing)}")
            for f in funcs:
                f.decorator_list = []
            mod = ast.Module(body=list(funcs), type_ignores=[])
            ns: dict[str, Any] = {}
            exec(compile(mod, f"{path}:{cls}", "exec"), ns)
            return {n: ns[n] for n in names}
    raise SystemExit(f"{path}: no class {cls}")
