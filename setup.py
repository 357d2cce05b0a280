"""Build hook for the C++ extension.

By default the package installs as pure Python and `offload._C` is compiled by ninja on first use
(cached, see offload/_ext.py). Set OFFLOAD_BUILD_EXT=1 to compile it ahead of time here instead,
with the same sources and flags.
"""
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload import env  # noqa: E402 - the checkout's (no torch import): every OFFLOAD_* variable is read there

if env.BUILD_EXT.on():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    from offload._build_spec import build_spec

    spec = build_spec()
    setup(
        ext_modules=[
            CppExtension(
                "offload._C",
                sources=spec.sources,
                include_dirs=spec.include_dirs,
                extra_compile_args=spec.cflags,
                extra_link_args=spec.ldflags,
            )
        ],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
else:
    setup()
