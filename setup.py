"""Build the compiled hot path under ``mooncake/_fast``.

The package is importable without any of these extensions (``MOONCAKE_NO_EXTENSIONS=1`` forces the
pure-Python twins); building them needs only gcc and the Python headers. The verbs layer declares
the libibverbs ABI itself (``mooncake/_fast/csrc/mc_verbs_abi.h``) and opens the library at run
time, so neither libibverbs nor its headers are needed to build. ``libmcsoftverbs.so`` is the
project's software verbs provider (tests and hosts without RNICs).
"""

from __future__ import annotations

import os
import sys
import sysconfig

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CFLAGS = ["-O3", "-fno-strict-aliasing"]
CSRC = "mooncake/_fast/csrc"
SOFT_PROVIDER = "mooncake._fast.libmcsoftverbs"
C_ABI = "mooncake._fast.lib.libtransfer_engine"  # Mooncake's C ABI: lib/ + include/ = MOONCAKE_ROOT
LIB_NAMES = {
    SOFT_PROVIDER: "libmcsoftverbs.so",
    C_ABI: "libtransfer_engine.so",
}

VERBS_MODULES = ["_verbs_lib", "_verbs_device", "_verbs_pd", "_verbs_mr", "_verbs_cq", "_verbs_qp"]

extensions = [
    Extension(
        "mooncake._fast._io",
        ["mooncake/_fast/_io.pyx"],
        include_dirs=[CSRC],
        depends=[f"{CSRC}/mc_copy.h"],
        extra_compile_args=CFLAGS,
    ),
    # libcudart is dlopen()ed at run time: no CUDA headers or libraries at build time
    Extension("mooncake._fast._cuda", ["mooncake/_fast/_cuda.pyx"], extra_compile_args=CFLAGS),
    *(
        Extension(
            f"mooncake._fast.{m}",
            [f"mooncake/_fast/{m}.pyx"],
            include_dirs=[CSRC],
            extra_compile_args=CFLAGS,
        )
        for m in VERBS_MODULES
    ),
    Extension(
        "mooncake._fast._rdma_batch",
        ["mooncake/_fast/_rdma_batch.pyx"],
        include_dirs=[CSRC],
        extra_compile_args=CFLAGS,
    ),
    Extension("mooncake._fast._tcp", ["mooncake/_fast/_tcp.pyx"], extra_compile_args=CFLAGS),
    Extension(
        "mooncake._fast._copyq",
        ["mooncake/_fast/_copyq.pyx"],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread"],
    ),
    Extension(
        "mooncake._fast._crc32c",
        ["mooncake/_fast/_crc32c.pyx"],
        include_dirs=[CSRC],
        depends=[f"{CSRC}/mc_crc32c.h"],
        extra_compile_args=CFLAGS,
    ),
    Extension("mooncake._fast._intmap", ["mooncake/_fast/_intmap.pyx"], extra_compile_args=CFLAGS),
    Extension("mooncake._fast._kvenc", ["mooncake/_fast/_kvenc.pyx"], extra_compile_args=CFLAGS),
    Extension(
        "mooncake._fast._objtable",
        ["mooncake/_fast/_objtable.pyx"],
        include_dirs=[CSRC],
        depends=[f"{CSRC}/mc_objtable.h"],
        extra_compile_args=CFLAGS,
    ),
]

soft_provider = Extension(
    SOFT_PROVIDER,
    [f"{CSRC}/softverbs.c"],
    include_dirs=[CSRC],
    extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall"],
    extra_link_args=["-lpthread", f"-Wl,--version-script={CSRC}/softverbs.map"],
    depends=[f"{CSRC}/softverbs.map", f"{CSRC}/mc_verbs_abi.h"],
)


def c_abi_library() -> list[Extension]:
    """``libtransfer_engine.so``: links libpython (it embeds the interpreter when loaded into a
    process without one); skipped, with a note, where Python has no shared library."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not libdir:
        print("note: this Python has no libpython; not building libtransfer_engine.so")
        return []
    ver = sysconfig.get_config_var("LDVERSION") or sysconfig.get_config_var("VERSION")
    exe = sys.executable.replace("\\", "\\\\").replace('"', '\\"')
    return [
        Extension(
            C_ABI,
            [f"{CSRC}/transfer_engine_c.c"],
            include_dirs=["mooncake/_fast/include"],
            define_macros=[("MC_PYTHON_EXE", f'"{exe}"')],
            extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-std=gnu11"],
            extra_link_args=[f"-L{libdir}", f"-lpython{ver}", f"-Wl,-rpath,{libdir}", "-ldl"],
            depends=["mooncake/_fast/include/transfer_engine_c.h"],
        )
    ]


class BuildExt(build_ext):
    """Names the plain C libraries (not Python modules) ``libmcsoftverbs.so`` and
    ``lib/libtransfer_engine.so``."""

    def get_ext_filename(self, fullname: str) -> str:
        # distutils asks with the full dotted name and with the last component only
        for name, filename in LIB_NAMES.items():
            if fullname in (name, name.rsplit(".", 1)[1]):
                return os.path.join(*fullname.split(".")[:-1], filename)
        return super().get_ext_filename(fullname)

    def run(self) -> None:
        if self.inplace:  # lib/ is no package: nothing else creates it in the source tree
            for name in LIB_NAMES:
                os.makedirs(os.path.join(*name.split(".")[:-1]), exist_ok=True)
        super().run()

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name in LIB_NAMES:
            return []
        return super().get_export_symbols(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        *cythonize(
            extensions,
            language_level=3,
            compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
            quiet=True,
            force=bool(os.environ.get("MOONCAKE_CYTHON_FORCE")),
        ),
        soft_provider,
        *c_abi_library(),
    ],
)
