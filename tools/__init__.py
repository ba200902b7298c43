"""Repository tools, run from the repository root (`python -m tools.<name>`); not part of the installed package.

    kernel_model   static performance model of the CUDA kernels from their SASS (the CI gate in build_scripts/test.sh)
"""
