"""Build the Cython kernels in csrc/ as extension modules of the mmidx package.

Every ``csrc/<name>.pyx`` becomes ``mmidx.<name>``; adding a kernel file needs no change here. Headers
in ``csrc/`` (C loops a kernel includes) are dependencies of every extension, so they ship in the sdist.
"""

from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        f"mmidx.{pyx.stem}",
        [str(pyx)],
        depends=[str(header) for header in sorted(Path("csrc").glob("*.h"))],  # C parts of kernels
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
    for pyx in sorted(Path("csrc").glob("*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
