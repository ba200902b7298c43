"""Static performance model of the CUDA decode-attention and append kernels (a MODEL, not a measurement).

Run from the repository root: `python -m tools.kernel_model [--out FILE] [--fail-if-default-not-memory-bound]
[--fail-if-append-below-copy-bw]` (README.md here: method, assumptions, results). Modules, imports pointing down:

    __main__   the command line: analyze, predict, write the JSON records, print, gate
    report     the CI gates and the markdown table
    append     the append kernel's table and prediction
    predict    decode-step prediction per (GPU, model, batch, context), calibration
    analysis   the executed path of one kernel's SASS: counts per key tile and per CTA; the compile/analyze driver
    toolchain  nvcc, nvdisasm, cuobjdump
    kernels    the declared table of the decode kernels
    spec       the table's types
    sass       SASS parsing, basic blocks, loops, source tags
    banks      the shared-memory bank model
    plan       launch plans and occupancy
    shapes     GPUs, model shapes, paths, constants
"""
